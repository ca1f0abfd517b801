"""Preference tuning's step on the 4-bit, sharded model: DPO starts at exactly log 2, k micro-batches equal one
batch, two ranks equal one, the reference is the base with the adapter off, each sequence's log-probability is
plain transformers' (bitsandbytes NF4); ORPO and SimPO need no reference."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file

from qlora_fsdp.commands.generate import main as generate_main
from qlora_fsdp.commands.merge import main as merge_main
from qlora_fsdp.data.batching import collate_packed
from qlora_fsdp.data.pair_pipeline import load_pairs
from qlora_fsdp.labels import IGNORE_INDEX
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.loading.placement import copy_full_into
from qlora_fsdp.losses.pair_losses import as_pairs
from qlora_fsdp.objectives.pair_steps import accumulate_pairs, pair_rows
from tests.helpers import (
    REPO,
    command_here,
    full_grads,
    head_of,
    rank_units,
    recipe_pair_loss,
    relative_difference,
    run_cli,
    run_ranks_sequence,
    split_parts,
    tiny_config,
    train_here,
    transformers_nf4,
)
from tests.test_resume import finish, kill_tree, start, torchrun, wait_for_step

pytestmark = pytest.mark.slow  # gloo ranks

PREFERENCES = str(REPO / "data" / "tiny_preferences.jsonl")


def dpo_config(model_dir, objective: str = "dpo", fsdp=None, **preference):
    cfg = tiny_config(model_dir, data={"path": PREFERENCES, "format": "chat", "context_length": 128,
                                       "eval_samples": 8},
                      train={"objective": objective}, preference=preference, fsdp=fsdp or {})
    cfg.lora.dropout = 0.0
    return cfg


def pair_micro_batches(cfg, n_pairs: int, pairs_per_batch: int, rank: int, world_size: int):
    """This rank's micro-batches of the first pairs: its share of them, or, with the rows split over the ranks
    (fsdp.context_parallel), its part of every micro-batch (pairs crossing the split)."""
    tokenizer = load_tokenizer(cfg)
    data = load_pairs(tokenizer, cfg)
    rows = pair_rows(data.samples(data.train, list(range(n_pairs))))
    mine = [rows[i] for i in rank_units(n_pairs, cfg, rank, world_size)]
    batches = [collate_packed(mine[i : i + pairs_per_batch], tokenizer.pad_token_id)
               for i in range(0, len(mine), pairs_per_batch)]
    return split_parts(batches, cfg, rank, tokenizer.pad_token_id)


def nudge_adapter(model) -> None:
    """Set the adapter's B matrices (zero at the start) to a fixed pattern, the same whatever the sharding."""
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            copy_full_into(parameter, 0.05 * torch.sin(torch.arange(parameter.numel(), dtype=torch.float32)).view(
                parameter.shape))


def step(info, cfg, n_pairs: int, pairs_per_batch: int, perturb: bool = False):
    """One accumulated step over this rank's share of the first n_pairs: loss, metrics, gathered LoRA gradients.
    `perturb`: the adapter's B matrices nudged off zero first (so policy and reference differ)."""
    torch.manual_seed(0)
    model = build_sharded_model(cfg, info)
    if perturb:
        nudge_adapter(model)
    batches = pair_micro_batches(cfg, n_pairs, pairs_per_batch, info.rank, info.world_size)
    result = accumulate_pairs(model, batches, info.device, recipe_pair_loss(cfg, info.device))
    return {"loss": result.loss, "metrics": result.metrics, "pairs": result.n_samples, "grads": full_grads(model)}


def pair_logps(info, cfg, n_pairs: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each pair's (chosen, rejected) summed log-probabilities as DPO's step takes them: our 4-bit load, a pair's
    two sequences packed in one row, the recipe's chunked loss. The policy at the start (adapter zero: the base), the
    reference with the adapter nudged off zero (turned off: the base again), and the nudged policy."""
    torch.manual_seed(0)
    model = build_sharded_model(cfg, info)
    loss = recipe_pair_loss(cfg, info.device)
    (batch,) = pair_micro_batches(cfg, n_pairs, n_pairs, info.rank, info.world_size)
    out = {"policy": as_pairs(loss.sequence_logps(model, batch, info.device).detach(), batch)}
    nudge_adapter(model)
    out["reference"] = as_pairs(loss.reference_logps(model, batch, info.device), batch)
    out["nudged"] = as_pairs(loss.sequence_logps(model, batch, info.device).detach(), batch)
    return {name: (pairs.chosen.cpu(), pairs.rejected.cpu()) for name, pairs in out.items()}


@pytest.fixture(scope="module")
def dpo_one_rank(tiny_model_dir, tmp_path_factory) -> dict:
    """What DPO computes on one rank, in one start-up: the step at the start, perturbed, accumulated; the pairs'
    log-probabilities."""
    cfg = dpo_config(tiny_model_dir)
    results = run_ranks_sequence([(step, (cfg, 8, 8)), (step, (cfg, 8, 8, True)), (step, (cfg, 8, 2, True)),
                                  (pair_logps, (cfg, 8))], 1, tmp_path_factory.mktemp("dpo_one_rank"))
    return dict(zip(("start", "one_big", "accumulated", "logps"), results, strict=True)) | {"cfg": cfg}


def test_dpo_starts_at_log_2_and_accumulation_and_sharding_change_nothing(dpo_one_rank, tmp_path):
    """...and rows split over the two ranks (context parallel: the pairs cross the split) change nothing either."""
    cfg, start, one_big, accumulated = (dpo_one_rank[k] for k in ("cfg", "start", "one_big", "accumulated"))
    split_cfg = dpo_config(cfg.model.path, fsdp={"context_parallel": 2})
    sharded, split = run_ranks_sequence([(step, (cfg, 8, 2, True)), (step, (split_cfg, 8, 2, True))], 2, tmp_path)

    assert start["pairs"] == 8
    assert start["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the adapter starts at zero: policy = reference
    assert start["metrics"]["reward_margin"] == 0.0 and start["metrics"]["reward_accuracy"] == 0.5

    assert abs(one_big["loss"] - math.log(2)) > 1e-4  # the perturbed adapter moved it
    assert split["pairs"] == 8
    for other in (accumulated, sharded, split):
        assert other["loss"] == pytest.approx(one_big["loss"], rel=1e-5)
        assert relative_difference(other["grads"], one_big["grads"]) <= 1e-4
        for key, value in one_big["metrics"].items():
            assert other["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def transformers_pair_logps(model_dir, cfg, n_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's (chosen, rejected) log-probabilities from plain transformers + bitsandbytes NF4 (fp32), none of
    our code: log_softmax of each sequence's own logits, summed over its target tokens."""
    model, data = transformers_nf4(model_dir), load_pairs(load_tokenizer(cfg), cfg)
    sums = []
    with torch.no_grad():
        for sequence in data.samples(data.train, list(range(n_pairs))):  # chosen, rejected, chosen, ...
            logps = model(input_ids=torch.tensor([sequence.input_ids])).logits[0, :-1].log_softmax(-1)
            targets = torch.tensor(sequence.labels[1:])
            kept = targets != IGNORE_INDEX
            sums.append(logps[kept].gather(-1, targets[kept, None]).sum())
    both = torch.stack(sums)
    return both[0::2], both[1::2]


def test_dpo_log_probabilities_equal_transformers_log_softmax(tiny_model_dir, dpo_one_rank):
    """The chosen and rejected log-probabilities DPO's loss reads (a pair a row, chunked, our 4-bit load) equal plain
    transformers' on each sequence alone: the policy at the start and the reference (adapter off) alike. fp32 both:
    they differ by float rounding (2e-7 relative here)."""
    chosen, rejected = transformers_pair_logps(tiny_model_dir, dpo_one_rank["cfg"], 8)
    logps = dpo_one_rank["logps"]
    assert (chosen < 0).all() and (rejected < 0).all()
    for name in ("policy", "reference"):
        torch.testing.assert_close(logps[name][0], chosen, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(logps[name][1], rejected, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert (logps["nudged"][0] - chosen).abs().max() > 1e-2  # the nudged adapter matters: its reference is off


def test_reference_free_objectives_accumulate_and_split_rows_exactly(tiny_model_dir, tmp_path):
    """ORPO and SimPO: 4 micro-batches of 2 pairs, and those split over two ranks (context parallel; SimPO's
    length normalization and ORPO's chosen tokens count each sequence's targets over the split), against one
    batch of 8."""
    objectives = ("orpo", "simpo")
    whole = run_ranks_sequence([(step, (dpo_config(tiny_model_dir, objective), 8, size, True))
                                for objective in objectives for size in (8, 2)], 1, tmp_path / "one")
    split = run_ranks_sequence([(step, (dpo_config(tiny_model_dir, objective, fsdp={"context_parallel": 2}), 8, 2,
                                        True)) for objective in objectives], 2, tmp_path / "split")
    for index, objective in enumerate(objectives):
        one_big = whole[2 * index]
        for other in (whole[2 * index + 1], split[index]):
            assert other["loss"] == pytest.approx(one_big["loss"], rel=1e-5), objective
            assert relative_difference(other["grads"], one_big["grads"]) <= 1e-4, objective
            for key, value in one_big["metrics"].items():
                assert other["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (objective, key)
    assert whole[0]["metrics"]["chosen_nll"] > 0  # ORPO's NLL per chosen target token, over the step's


def losses_of(run_dir) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r or "eval_loss" in r]


def test_precomputed_reference_trains_as_the_adapter_off_one_and_a_stale_one_is_refused(tiny_model_dir, tmp_path):
    """A few DPO steps, and KTO steps, on 2 ranks with the reference computed on every micro-batch (adapter off) and
    computed once before training: the same losses and rewards (KTO's z0 too). The precomputed KTO run splits its
    rows over the two ranks (context parallel: its objective's batches, reference pass and evaluation across the
    split), the same rows a step as the two ranks of the other take. Resuming with other data refuses the stored
    reference."""
    common = [f"model.path={tiny_model_dir}", "train.max_steps=4", "train.eval_every=2", "data.eval_samples=16",
              f"data.cache_dir={tmp_path / 'cache'}", "train.save_every=2"]
    # the first 200 records of each file: the precomputed pass reads every training record, and 4 steps need few
    data = {"tiny_cpu_kto": "tiny_kto.jsonl", "tiny_cpu_dpo": "tiny_preferences.jsonl"}
    for recipe, name in data.items():
        head_of(name, 200, tmp_path)
        runs = {}
        for reference in ("adapter_off", "precomputed"):
            out = tmp_path / f"{recipe}_{reference}"
            split = (["fsdp.context_parallel=2", "data.micro_batch_size=4"]
                     if (recipe, reference) == ("tiny_cpu_kto", "precomputed") else [])
            results = run_cli(["--recipe", recipe, *common, f"train.output_dir={out}", f"data.path={tmp_path / name}",
                               f"preference.reference={reference}", *split], 2, tmp_path)
            assert results[0].returncode == 0, results[0].stderr[-2000:]
            runs[reference] = losses_of(out)
        assert (tmp_path / f"{recipe}_precomputed" / "reference_logps.safetensors").is_file()
        assert not (tmp_path / f"{recipe}_adapter_off" / "reference_logps.safetensors").exists()
        # the start's eval, steps 1 to 4 (an eval at 2), the end's eval
        assert len(runs["precomputed"]) == len(runs["adapter_off"]) == 6
        for ours, theirs in zip(runs["precomputed"], runs["adapter_off"], strict=True):
            for key in ("loss", "eval_loss", "reward_accuracy", "reward_margin", "eval_reward_margin", "kl",
                        "rewards_desirable", "eval_rewards_undesirable"):
                if key in theirs:
                    assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, ours, theirs)
        moved = "rewards_desirable" if recipe == "tiny_cpu_kto" else "reward_margin"  # the policy left the reference
        assert any(record.get(moved, 0.0) != 0.0 for record in runs["adapter_off"])

    other = tmp_path / "other.jsonl"
    other.write_text("".join(list((REPO / "data" / "tiny_preferences.jsonl").open())[200:400]))
    resumed = run_cli(["--recipe", "tiny_cpu_dpo", *common, "train.max_steps=6",
                       f"train.output_dir={tmp_path / 'tiny_cpu_dpo_precomputed'}",
                       "preference.reference=precomputed", f"data.path={other}", "--resume"], 2, tmp_path)
    assert resumed[0].returncode != 0
    assert {r.returncode for r in resumed} == {2}  # a user error: one line, exit 2
    said = "".join(r.stdout + r.stderr for r in resumed)  # the terminal shows every rank's; one rank says it
    assert "reference_logps.safetensors holds reference log-probabilities of other data or another base model" in said


def test_tiny_cpu_dpo_learns_its_rule_on_two_ranks(tiny_model_dir, tmp_path):
    """`make demo-dpo`'s recipe, shortened: held-out reward accuracy from 0.5 (policy = reference: ties) to 0.9 or
    more, in the summary and metrics.jsonl; the adapter is written."""
    out = tmp_path / "run"
    results = run_cli(["--recipe", "tiny_cpu_dpo", f"model.path={tiny_model_dir}", "train.max_steps=30",
                       "data.eval_samples=100", f"train.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}"],
                      2, tmp_path)
    assert results[0].returncode == 0, results[0].stderr[-2000:]
    summary = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["eval_reward_accuracy_start"] == 0.5 and summary["eval_reward_accuracy_end"] >= 0.9, summary
    assert summary["eval_loss_start"] == pytest.approx(math.log(2), abs=1e-5) and summary["eval_loss_end"] < 0.5
    assert "eval_ppl_end" not in summary
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_dpo_from_an_sft_adapter_compares_against_it_and_its_adapter_merges_and_samples(tiny_model_dir, tmp_path):
    """SFT for a few steps, then DPO from that adapter (model.adapter): at step 0 the policy is the reference (base
    plus the SFT adapter), so the loss is log 2, not what the bare base would give. The DPO adapter then merges and
    samples like any other. adapter_off with a starting adapter is refused in one line."""
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    sft = run_cli(["--recipe", "tiny_cpu", f"model.path={tiny_model_dir}", "train.max_steps=6", "optim.lr=1e-2",
                   f"train.output_dir={tmp_path / 'sft'}", cache], 2, tmp_path)
    assert sft[0].returncode == 0, sft[0].stderr[-2000:]
    pairs = head_of("tiny_preferences.jsonl", 200, tmp_path)  # a small file keeps the two reference passes short
    base_args = ["--recipe", "tiny_cpu_dpo", f"model.path={tiny_model_dir}", f"data.path={pairs}",
                 "data.eval_samples=16", cache]
    dpo_args = [*base_args, f"model.adapter={tmp_path / 'sft' / 'adapter'}", "train.max_steps=2",
                f"train.output_dir={tmp_path / 'dpo'}"]
    dpo = run_cli(dpo_args, 2, tmp_path)
    assert dpo[0].returncode == 0, dpo[0].stderr[-2000:]
    summary = json.loads((tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["eval_loss_start"] == pytest.approx(math.log(2), abs=1e-6)
    assert summary["eval_reward_accuracy_start"] == 0.5
    assert (tmp_path / "dpo" / "reference_logps.safetensors").is_file()
    # the reference is the SFT adapter's, not the bare base's: the base's own reference differs
    bare = run_cli([*base_args, "train.max_steps=1", "preference.reference=precomputed",
                    f"train.output_dir={tmp_path / 'bare'}"], 2, tmp_path)
    assert bare[0].returncode == 0, bare[0].stderr[-2000:]
    with_adapter, base_only = (load_file(tmp_path / run / "reference_logps.safetensors")["train"]
                               for run in ("dpo", "bare"))
    assert (with_adapter - base_only).abs().max() > 1e-2
    refused = train_here([*dpo_args, "preference.reference=adapter_off", "--print-config"])
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        "error: 'preference.reference: adapter_off' would compare against the base without model.adapter's weights")

    adapter = tmp_path / "dpo" / "adapter"
    merged = command_here(merge_main, ["--adapter", adapter, "--out", tmp_path / "merged"])
    assert merged.returncode == 0, merged.stderr[-2000:]
    sampled = command_here(generate_main, ["--adapter", adapter, "--prompt", "What is the capital of Peru?",
                                           "--max-new-tokens", "8"])
    assert sampled.returncode == 0 and sampled.stdout.strip(), sampled.stderr[-2000:]


def test_a_dpo_run_killed_hard_and_resumed_equals_the_uninterrupted_one(tiny_model_dir, tmp_path):
    """torchrun, 2 ranks, the reference precomputed: killed with SIGKILL (torchrun and both ranks) at a random step
    after its first checkpoint, then resumed. The resumed run reads the stored reference (not recomputed), and its
    losses, rewards and final adapter are the uninterrupted run's, bit for bit."""
    subset = head_of("tiny_preferences.jsonl", 300, tmp_path)  # a small file keeps the reference pass short
    common = ["--recipe", "tiny_cpu_dpo", f"model.path={tiny_model_dir}", f"data.path={subset}",
              "data.eval_samples=16", "train.max_steps=6", "train.save_every=2", "train.eval_every=3",
              f"data.cache_dir={tmp_path / 'cache'}", "preference.reference=precomputed"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run_cli([*common, f"train.output_dir={whole}"], 2, tmp_path)[0].returncode == 0

    kill_at = random.Random().randint(3, 4)  # after step 2's checkpoint, before the run ends
    proc = start(torchrun("train.py", *common, f"train.output_dir={part}"))
    wait_for_step(part, kill_at, proc)
    kill_tree(proc)  # no warning to anyone
    finish(proc)
    assert not (part / "adapter").exists(), f"killed at step {kill_at} but the run had finished"
    stored = part / "reference_logps.safetensors"
    written = stored.stat().st_mtime_ns
    resumed = run_cli([*common, f"train.output_dir={part}", "--resume"], 2, tmp_path)
    assert resumed[0].returncode == 0, resumed[0].stderr[-2000:]
    assert "resumed from" in resumed[0].stdout, f"killed at step {kill_at}"
    assert stored.stat().st_mtime_ns == written  # read back, not computed again

    def steps(run_dir):
        return {r["step"]: r for r in losses_of(run_dir) if "loss" in r}

    uninterrupted, continued = steps(whole), steps(part)
    assert sorted(continued) == sorted(uninterrupted) == [1, 2, 3, 4, 5, 6]
    for step_, record in uninterrupted.items():
        for key in ("loss", "reward_accuracy", "reward_margin", "rewards_chosen", "grad_norm"):
            assert continued[step_][key] == record[key], (step_, key, kill_at)
    ours, theirs = (load_file(run / "adapter" / "adapter_model.safetensors") for run in (part, whole))
    assert ours.keys() == theirs.keys() and len(ours) > 0 and all(torch.equal(ours[k], theirs[k]) for k in ours)
