"""GRPO (train.objective grpo): the update against TRL 1.16's GRPOTrainer on transformers + bitsandbytes + PEFT,
rewards, advantages, and a run that generates, scores and updates at world sizes 1 and 2.

The update: fixed completions of fixed prompts (some ending in EOS, some cut at max_completion_length), the same
advantages, old and reference log-probabilities on both sides; TRL's `compute_loss` on its own 4-bit model with
the adapter loaded by PEFT (one process, the whole batch: TRL's one big batch; for bnpo, which TRL normalizes per
micro-batch, the same micro-batches accumulated) against ours at world size 1 (two micro-batches, padded rows) and
2 (two micro-batches a rank, packed rows): the loss and every LoRA gradient, for the four loss types at both
importance-sampling levels (token, and GSPO's sequence), with clip-higher, delta, the KL term and truncated
completions masked among them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from qlora_fsdp.config import GenerationConfig, GrpoConfig
from qlora_fsdp.losses.policy import group_advantages
from tests.helpers import (
    FSDP2_ALL_GATHER,
    build_tiny_checkpoint,
    decoder_lora_keys,
    full_grads,
    generation_plan,
    run_cli,
    run_ranks,
    run_ranks_sequence,
    tiny_config,
)

PROMPTS, GENERATIONS, PROMPT_LENGTH = 4, 2, 6
TEMPERATURE = 0.7
# TRL's settings, each a GrpoConfig of ours with the same meaning: every loss type at both importance-sampling levels,
# with the KL term, clip-higher, delta and masked truncated completions spread over them
EXTRAS = {
    ("dapo", "token"): dict(beta=0.04, epsilon_high=0.28), ("dapo", "sequence"): dict(mask_truncated_completions=True),
    ("grpo", "token"): dict(beta=0.04, delta=1.5), ("grpo", "sequence"): dict(delta=1.5),
    ("dr_grpo", "token"): dict(beta=0.1), ("dr_grpo", "sequence"): dict(epsilon_high=0.28),
    ("bnpo", "token"): dict(mask_truncated_completions=True), ("bnpo", "sequence"): dict(beta=0.04),
}
SETTINGS = {f"{loss}_{level}": dict(loss_type=loss, importance_sampling_level=level, **extra)
            for (loss, level), extra in EXTRAS.items()}
MAX_COMPLETION = 7


def completions(eos: int) -> tuple[list[list[int]], list[list[int]], list[bool]]:
    """Prompts (one length: TRL passes no position ids, so left padding would move its positions) and completions
    of 2 to 7 tokens: those ending in EOS finished, the 7-token ones without it were cut (truncated)."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 500, (PROMPT_LENGTH,), generator=generator).tolist() for _ in range(PROMPTS)]
    ids, truncated = [], []
    for index in range(PROMPTS * GENERATIONS):
        length = 2 + index % 6
        tokens = torch.randint(10, 500, (length,), generator=generator).tolist()
        if index % 3 != 2 or length < MAX_COMPLETION:
            tokens[-1] = eos
        ids.append(tokens)
        truncated.append(tokens[-1] != eos and length == MAX_COMPLETION)
    return prompts, ids, truncated


GENERATION = GenerationConfig(num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION,
                              temperature=TEMPERATURE)


def grpo_settings(name: str) -> GrpoConfig:
    return GrpoConfig(**SETTINGS[name])


def our_update(info, model_dir: Path, adapter: Path | None, old_ref: dict | None, packed: bool,
               settings: tuple[str, ...] = tuple(SETTINGS), micro: int = 2, lora: dict | None = None,
               context: int = 64, split: bool = False) -> dict:
    """Each setting's step loss and LoRA gradients on our model; world size 1 also writes the adapter (LoRA B
    seeded away from zero, so every LoRA tensor has a gradient) and returns the old and reference log-probabilities
    both sides then use (its own, moved by seeded noise so that ratios reach past the clip). `split`: the ranks
    share every prompt, each micro-batch's rows split over them (context parallel)."""
    from qlora_fsdp.distributed.row_groups import row_split
    from qlora_fsdp.loading.adapter import adapter_file_key, export_adapter, load_adapter_into
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.loading.fill import model_layout
    from qlora_fsdp.losses.forward import ForwardLoss
    from qlora_fsdp.losses.policy import StepCounts
    from qlora_fsdp.objectives.base import RunParts
    from qlora_fsdp.objectives.grpo import Grpo
    from qlora_fsdp.objectives.grpo_records import Generation, completion_sample

    cfg = tiny_config(model_dir, data={"packing": packed, "context_length": context, "format": "prompt"},
                      train={"objective": "grpo"}, lora=lora or {},
                      fsdp={"context_parallel": info.world_size if split else 1})
    tokenizer = load_tokenizer(cfg)
    model = build_sharded_model(cfg, info)
    if adapter is None:
        generator = torch.Generator().manual_seed(0)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.data.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        adapter = Path(cfg.train.output_dir).parent / "grpo_adapter"
        export_adapter(model, tokenizer, adapter, cfg.model.path, info.is_main, "")
    else:
        load_adapter_into(model, adapter)
    model.train()
    prompts, ids, truncated = completions(tokenizer.eos_token_id)
    rows_split = row_split(cfg.fsdp.context_parallel)
    takers, taker = rows_split.data_ranks, rows_split.data_rank
    mine = range(taker * PROMPTS // takers, (taker + 1) * PROMPTS // takers)
    rows = [p * GENERATIONS + g for p in mine for g in range(GENERATIONS)]
    advantages = group_advantages(torch.tensor([float(i % 5) for i in range(len(ids))]), GENERATIONS, "group")
    out: dict = {"adapter": adapter, "settings": {}}
    for name in settings:
        grpo = grpo_settings(name)
        masked = [grpo.mask_truncated_completions and truncated[i] for i in rows]
        samples = [completion_sample(prompts[i // GENERATIONS], ids[i], m) for i, m in zip(rows, masked, strict=True)]
        steps = Grpo(dataclasses.replace(cfg, grpo=grpo, generation=GENERATION), ForwardLoss(), rewards=[])
        steps.attach(RunParts(info, model, None, tokenizer.pad_token_id, None, rows_split, tokenizer))
        if old_ref is None:  # our own log-probabilities, moved: both sides' old and reference
            noise = torch.Generator().manual_seed(1)
            current = steps.logps_by_completion(samples, list(range(len(samples))), adapter=True)
            old_ref = {kind: [lp + 0.3 * torch.randn(lp.shape, generator=noise) for lp in current]
                       for kind in ("old", "ref")}
            out["old_ref"] = old_ref
        tokens = sum(len(ids[i]) for i, m in zip(range(len(ids)), [grpo.mask_truncated_completions and t
                                                                   for t in truncated], strict=True) if not m)
        per = len(rows) // micro  # micro-batches a rank (two: accumulation at both world sizes)
        kept = [old_ref["old"][i] if not m else old_ref["old"][i][:0] for i, m in zip(rows, masked, strict=True)]
        ref = [old_ref["ref"][i] if not m else old_ref["ref"][i][:0] for i, m in zip(rows, masked, strict=True)]
        steps.current = Generation(samples, [list(range(s, s + per)) for s in range(0, len(rows), per)],
                                   advantages[rows], kept, ref if grpo.beta else None,
                                   StepCounts(len(ids), tokens, micro * takers), {})
        result = steps.step(1.0)
        grads = {adapter_file_key(key, model_layout(model)): grad for key, grad in full_grads(model).items()}
        out["settings"][name] = {"loss": result.loss, "grads": grads, "entropy": result.metrics["entropy"],
                                 "router_aux_loss": result.metrics.get("router_aux_loss")}
        model.zero_grad(set_to_none=True)
    return out


def trl_update(model_dir: Path, adapter: Path, old_ref: dict, settings: tuple[str, ...] = tuple(SETTINGS),
               splits: int = 1, base: torch.nn.Module | None = None) -> dict:
    """TRL's GRPOTrainer.compute_loss, one process, on transformers' 4-bit model (or `base`) + PEFT: the whole batch
    in `splits` consecutive micro-batches, gradients accumulated as TRL accumulates them."""
    from accelerate import Accelerator
    from peft import PeftModel
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from qlora_fsdp.loading.adapter import peft_adapter_key
    from tests.helpers import transformers_nf4

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = base if base is not None else transformers_nf4(model_dir)
    expected_keys = decoder_lora_keys(base)  # before PEFT wraps the modules
    text_config = base.config.get_text_config()
    aux_coefficient = getattr(text_config, "router_aux_loss_coef", 0.0) or 0.0
    model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    add_fused_lm_head(model.get_base_model(), temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    model.train()
    prompts, ids, truncated = completions(tokenizer.eos_token_id)
    rows = len(ids)
    width = max(len(i) for i in ids)
    prompt_ids = torch.tensor([prompts[i // GENERATIONS] for i in range(rows)])
    completion_ids = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids])
    advantages = group_advantages(torch.tensor([float(i % 5) for i in range(rows)]), GENERATIONS, "group")
    out = {"expected_keys": expected_keys, "settings": {}}
    for name in settings:
        grpo = grpo_settings(name)
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
        if grpo.mask_truncated_completions:
            mask[torch.tensor(truncated)] = 0
        trainer = object.__new__(GRPOTrainer)
        trainer.args = GRPOConfig(output_dir=str(adapter.parent / "trl"), bf16=False, use_cpu=True, report_to="none",
                                  per_device_train_batch_size=rows // splits, num_generations=GENERATIONS,
                                  gradient_accumulation_steps=splits,  # steps_per_generation follows it
                                  gradient_checkpointing=False, **{k: v for k, v in SETTINGS[name].items()
                                                                    if k in ("delta", "mask_truncated_completions")})
        trainer.accelerator, trainer.model = Accelerator(cpu=True), model
        for key, value in dict(top_entropy_quantile=1.0, importance_sampling_level=grpo.importance_sampling_level,
                               off_policy_mask_threshold=None, beta=grpo.beta, loss_type=grpo.loss_type,
                               epsilon_low=grpo.epsilon, epsilon_high=grpo.resolved_epsilon_high, use_vllm=False,
                               vllm_importance_sampling_correction=False, max_completion_length=MAX_COMPLETION,
                               current_gradient_accumulation_steps=splits, _entropy_bonus_enabled=False,
                               # TRL's rule: a config with the router switch at all, and a non-zero coefficient
                               aux_loss_enabled=hasattr(text_config, "output_router_logits") and aux_coefficient != 0,
                               router_aux_loss_coef=aux_coefficient,
                               _metrics={"train": defaultdict(list), "eval": defaultdict(list)}).items():
            setattr(trainer, key, value)

        def padded(per_completion: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([torch.cat([lp, lp.new_zeros(width - len(lp))]) for lp in per_completion])

        inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
                  "completion_ids": completion_ids, "completion_mask": mask, "advantages": advantages,
                  "old_per_token_logps": padded(old_ref["old"]) * mask}
        if grpo.beta:
            inputs["ref_per_token_logps"] = padded(old_ref["ref"]) * mask
        model.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        for part in torch.arange(rows).chunk(splits):  # TRL's micro-batches; num_items_in_batch is the step's
            micro_loss = trainer.compute_loss(model, {**{k: v[part] for k, v in inputs.items()},
                                                      "num_items_in_batch": mask.sum()})
            micro_loss.backward()
            loss = loss + micro_loss.detach()
        grads = {peft_adapter_key(n, "default"): p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.requires_grad}
        entropy = trainer._metrics["train"]["entropy"][-splits:]  # each micro-batch's mean: weighted by tokens
        weights = [int(mask[part].sum()) for part in torch.arange(rows).chunk(splits)]
        aux = trainer._metrics["train"]["aux_loss"][-splits:]  # each micro-batch's: their mean is the step's
        out["settings"][name] = {"loss": loss.item(), "grads": grads, "aux_loss": sum(aux) / splits if aux else None,
                                 "entropy": sum(e * w for e, w in zip(entropy, weights, strict=True)) / sum(weights)}
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


@pytest.mark.old_torch  # run on torch 2.11 too (make test-old-torch)
@pytest.mark.slow
def test_the_update_equals_trls_at_world_sizes_1_and_2(tmp_path):
    model_dir = build_tiny_checkpoint(tmp_path / "model")
    one = run_ranks(our_update, 1, model_dir, None, None, False, tmp_dir=tmp_path)[0]
    two, split = run_ranks_sequence([(our_update, (model_dir, one["adapter"], one["old_ref"], True)),
                                     (our_update, (model_dir, one["adapter"], one["old_ref"], True, tuple(SETTINGS), 2,
                                                   None, 64, True))], 2, tmp_path / "ranks")
    trl = trl_update(model_dir, one["adapter"], one["old_ref"])
    # bnpo is TRL's one loss normalized per micro-batch: against TRL accumulating the same micro-batches (2 at world
    # size 1; 2 a rank at 2, in rank order)
    bnpo = tuple(name for name in SETTINGS if name.startswith("bnpo"))
    by_micro_batches = {1: trl_update(model_dir, one["adapter"], one["old_ref"], bnpo, splits=2),
                        2: trl_update(model_dir, one["adapter"], one["old_ref"], bnpo, splits=4)}
    assert len(trl["expected_keys"]) >= 8
    for name in SETTINGS:
        references = {size: (by_micro_batches[size] if name in bnpo else trl)["settings"][name] for size in (1, 2)}
        print(f"{name}: TRL {references[1]['loss']:.7f} {references[2]['loss']:.7f}, ours "
              f"{one['settings'][name]['loss']:.7f} (ws1) {two['settings'][name]['loss']:.7f} (ws2)")
        assert references[1]["grads"].keys() >= trl["expected_keys"]
        # and the rows split over two ranks (context parallel): one rank's micro-batches, as at world size 1
        for size, run in ((1, one), (2, two), (1, split)):
            reference, ours = references[size], run["settings"][name]
            # abs 1e-6: a loss is a sum of token terms of both signs (grpo_token's, -0.0233, agrees to 3e-7: 1.2e-5
            # relative); the two 4-bit forwards (ours, bitsandbytes') differ at float rounding
            assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-6), name
            assert ours["entropy"] == pytest.approx(reference["entropy"], rel=1e-5), name  # the logged mean
            assert ours["grads"].keys() == reference["grads"].keys(), name
            for key, grad in reference["grads"].items():
                assert relative(ours["grads"][key], grad) < 1e-5, (name, key)



@pytest.mark.slow
def test_a_mixture_of_experts_update_equals_trls_with_its_load_balancing_loss(tmp_path):
    """Qwen3-MoE with LoRA on its 4-bit experts and trained routers: the update (dapo, token) equals TRL's, whose
    load-balancing loss joins it (the config has the router switch and a coefficient): at world size 1 in two
    padded micro-batches, at 2 in one packed micro-batch a rank, and with the two's rows split over two ranks,
    against TRL accumulating the same two."""
    from qlora_fsdp.tools.tiny_model import train_tokenizer
    from tests.families import write_family_model
    from tests.helpers import REPO
    from tests.test_families import expected_adapter_keys, reference_model

    model_dir = write_family_model(tmp_path / "moe", "qwen3_moe", train_tokenizer(REPO / "data" / "tiny_instruct.jsonl",
                                                                                  512))
    lora = {"r": 4, "dropout": 0.0, "target_experts": True, "train_router": True}
    settings = ("dapo_token",)
    one = run_ranks(our_update, 1, model_dir, None, None, False, settings, 2, lora, tmp_dir=tmp_path)[0]
    # packed into rows of 24 tokens: two or so completions a row, rows with padding tails the routers must not count
    # and those two micro-batches' rows split over the two ranks (context parallel: the routers' statistics summed
    # over the split)
    two, split = run_ranks_sequence(
        [(our_update, (model_dir, one["adapter"], one["old_ref"], True, settings, 1, lora, 24)),
         (our_update, (model_dir, one["adapter"], one["old_ref"], True, settings, 2, lora, 24, True))], 2,
        tmp_path / "ranks")
    base = reference_model(model_dir)
    expected = expected_adapter_keys(base)
    trl = trl_update(model_dir, one["adapter"], one["old_ref"], settings, splits=2, base=base)
    reference = trl["settings"]["dapo_token"]
    assert reference["grads"].keys() >= expected and any("router" in key or "gate.weight" in key for key in expected)
    for run in (one, two, split):
        ours = run["settings"]["dapo_token"]
        print(f"MoE dapo_token: TRL {reference['loss']:.7f}, ours {ours['loss']:.7f}")
        assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-6)
        assert ours["router_aux_loss"] == pytest.approx(reference["aux_loss"], rel=1e-5)
        for key, grad in reference["grads"].items():
            assert relative(run["settings"]["dapo_token"]["grads"][key], grad) < 1e-5, key

# ---- advantages and rewards (in process) --------------------------------------------------------------------------

def test_a_completion_ends_at_its_first_eos_and_only_a_cut_one_is_truncated():
    """A completion keeps its tokens through its first EOS and is not truncated; one with no EOS ran to
    max_completion_length and is, unless a stop string ended it (then padded to the longest row)."""
    from qlora_fsdp.objectives.rollouts import cut

    class Words:
        @staticmethod
        def decode(ids):
            return " ".join(str(i) for i in ids)

    eos, pad = 2, 0
    assert cut([5, 6, eos, 9, eos], {eos}, pad, [], Words()) == ([5, 6, eos], False)
    assert cut([eos, 6, 7], {eos}, pad, [], Words()) == ([eos], False)
    assert cut([5, 6, 7], {eos}, pad, [], Words()) == ([5, 6, 7], True)
    assert cut([5, 6, pad, pad], {eos}, pad, ["6"], Words()) == ([5, 6], False)  # a stop string ended it
    assert cut([5, 6, 7], {eos}, pad, ["6"], Words()) == ([5, 6, 7], True)


def test_a_run_continuing_an_adapter_keeps_it_frozen_as_the_reference_and_the_plan_counts_it():
    """model.adapter with beta > 0: the reference's forward runs on the adapter as it was when the objective
    attached (TRL's "ref" copy), the trained values come back after it, and the plan holds the copy's bytes; with a
    fresh adapter or no KL term, nothing is kept."""
    from qlora_fsdp.config import Config
    from qlora_fsdp.measure.fake_step import planned_objective
    from qlora_fsdp.measure.held import Held
    from qlora_fsdp.objectives.reference_adapter import adapter_weights, frozen_adapter
    from qlora_fsdp.plan.memory import resident_rows

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    model[1].weight.requires_grad_(False)  # the frozen base: never copied
    frozen = frozen_adapter(model)
    assert frozen.keys() == {"0.weight", "0.bias", "1.bias"}
    started = {name: value.clone() for name, value in frozen.items()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # training moved them
    trained = {name: param.detach().clone() for name, param in model.named_parameters()}
    with adapter_weights(model, frozen):
        assert all(torch.equal(model.get_parameter(name), value) for name, value in started.items())
        assert torch.equal(model[1].weight, trained["1.weight"])
    assert all(torch.equal(param, trained[name]) for name, param in model.named_parameters())

    def config(objective: str, adapter: str | None, beta: float) -> Config:
        cfg = Config()
        cfg.train.objective, cfg.model.adapter, cfg.grpo.beta, cfg.rloo.beta = objective, adapter, beta, beta
        return cfg

    held = Held(lora=12345)
    cases = ((None, 0.04, False), ("sft/adapter", 0.0, False), ("sft/adapter", 0.04, True))
    for objective, (adapter, beta, kept) in ((o, case) for o in ("grpo", "rloo") for case in cases):
        cfg = config(objective, adapter, beta)
        copies = [row.bytes for row in resident_rows(held, cfg) if "reference" in row.name]
        kept_here = planned_objective(cfg).keeps_reference_adapter()
        assert kept_here == kept and copies == ([12345] if kept else []), (objective, adapter, beta)


@pytest.mark.old_torch  # it reaches the compiler (run on torch 2.11 too: make test-old-torch)
def test_one_generation_plan_and_one_layout_rule_for_the_run_and_the_plan(monkeypatch):
    """A step's generation resolved once: its rows a call (generation.rows, capped at the rank's completions), its
    calls, and the layout `auto` takes: gathered where it fits, else split where it fits, else per_token; the run
    asks the GPU's free memory, the plan its planned bytes, both through chosen_layout."""
    from qlora_fsdp.config import Config
    from qlora_fsdp.generation import layouts
    from qlora_fsdp.generation.plan import chosen_layout
    from qlora_fsdp.measure.fake_step import planned_objective
    from qlora_fsdp.plan import memory

    cfg = Config()
    cfg.train.objective, cfg.data.micro_batch_size, cfg.data.grad_accum_steps = "rloo", 2, 3
    cfg.generation.num_generations, cfg.generation.rows = 4, 5
    made = planned_objective(cfg).planned_generation()
    assert (made.prompts, made.completions, made.rows, made.calls) == (6, 24, 5, 5)
    cfg.generation.rows = 100  # more rows than the rank generates: one call of its 24
    assert (planned_objective(cfg).planned_generation().rows, planned_objective(cfg).planned_generation().calls) == (
        24, 1)
    asked: list[str] = []

    def fits(answer: bool):  # noqa: ANN202 (the rule's question, counted)
        return lambda: asked.append("asked") or answer

    assert chosen_layout("auto", 2, fits(True), fits(True)) == "gathered" and len(asked) == 1  # split not asked
    assert chosen_layout("auto", 2, fits(False), fits(True)) == "split"
    assert chosen_layout("auto", 2, fits(False), fits(False)) == "per_token"  # the least memory
    assert chosen_layout("auto", 1, fits(False), fits(True)) == "per_token" and len(asked) == 6  # no ranks to split
    assert chosen_layout("per_token", 2, fits(True), fits(True)) == "per_token" and len(asked) == 6
    # both sides hand the rule their own answer: the run's free memory, the plan's bytes
    seen = []
    monkeypatch.setattr(layouts, "chosen_layout", lambda *args: seen.append(("run", args[:2])) or "split")
    monkeypatch.setattr(memory, "chosen_layout", lambda *args: seen.append(("plan", args[:2])) or "split")
    layouts.resolved_layout(torch.nn.Linear(2, 2), made, 4, 8, torch.device("cpu"))
    memory.planned_layout(None, None, cfg, None)
    assert seen == [("run", ("auto", 1)), ("plan", ("auto", cfg.hardware.world_size))]


def test_advantages_are_trls_group_and_batch_normalization():
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 2.0, float("nan"), 3.0, 3.0, 0.5, -1.0])
    groups = rewards.view(-1, 4)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(4)
    group_std = torch.stack([nanstd(g) for g in groups]).repeat_interleave(4)
    expected = {"group": (rewards - mean) / (group_std + 1e-4), "batch": (rewards - mean) / (nanstd(rewards) + 1e-4),
                "none": rewards - mean}
    for scale, want in expected.items():
        got = group_advantages(rewards, 4, scale)
        torch.testing.assert_close(got, torch.nan_to_num(want, nan=0.0))
        assert got[3] == 0.0  # the completion no function scored
    assert torch.equal(group_advantages(torch.ones(4), 4, "group"), torch.zeros(4))  # a group with no spread


def test_rewards_built_in_and_errors_in_one_line(tmp_path, monkeypatch):
    from trl.rewards import get_soft_overlong_punishment

    from qlora_fsdp.config import RewardConfig
    from qlora_fsdp.errors import ConfigError
    from qlora_fsdp.rewards.builtin import format_reward, length_penalty, math_answer
    from qlora_fsdp.rewards.functions import RewardError, Rollouts, combined, resolve_rewards, score

    gold = ["Natalia sold 48/2 = 24 clips.\n#### 72", "#### 1,000", "\\boxed{\\frac{1}{2}}", "no answer here"]
    said = ["... so the answer is \\boxed{72}.", "It is 1000.", "#### 0.5", "42"]
    assert math_answer(said, gold) == [1.0, 1.0, 1.0, None]  # a gold answer without a final answer: not scored
    assert math_answer(["#### 71", [{"role": "assistant", "content": "\\boxed{1001}"}]], gold[:2]) == [0.0, 0.0]
    tagged = format_reward(["think", "answer"])
    assert tagged(["<think>a</think>\n<answer>b</answer>", "<answer>b</answer>", "<think>a<think>b</think><answer>c"
                   "</answer>"]) == [1.0, 0.0, 0.0]
    ids = [[1] * n for n in (3, 6, 7, 9, 12)]
    assert length_penalty(10, 4)(ids) == pytest.approx(get_soft_overlong_punishment(10, 4)(ids))

    monkeypatch.chdir(tmp_path)  # module:function imports from where training runs
    (tmp_path / "user_rewards.py").write_text(
        "def raising(completions, **kw):\n    if any('boom' in c for c in completions): raise KeyError('answer')\n"
        "    return [1.0] * len(completions)\n"
        "def short(completions, **kw):\n    return [1.0]\n"
        "def nan(completions, **kw):\n    return [float('nan')] * len(completions)\n"
        "def partial(completions, **kw):\n    return [None, 2.0] * (len(completions) // 2)\n")
    rewards = [RewardConfig("user_rewards:partial"), RewardConfig("format", 0.5)]
    rollouts = Rollouts(["p", "p", "q", "q"], ["x", "<think>a</think><answer>b</answer>", "boom", "y"],
                        [[1], [2], [3], [4]], [7, 7, 9, 9], {"answer": ["1", "1", "2", "2"]})
    scores = score(resolve_rewards(rewards, GenerationConfig()), rollouts)
    assert torch.equal(torch.isnan(scores[:, 0]), torch.tensor([True, False, True, False]))
    assert combined(scores, [1.0, 0.5]).tolist() == [0.0, 2.5, 0.0, 2.0]  # None skipped, not zeroed
    assert torch.isnan(combined(torch.tensor([[float("nan"), float("nan")]]), [1.0, 1.0])).all()
    errors = {"raising": "reward function user_rewards:raising raised KeyError: 'answer' (prompt 9 of the dataset)",
              "short": "reward function user_rewards:short returned 1 values for 4 completions",
              "nan": "reward function user_rewards:nan returned nan for a completion of prompt 7 of the dataset"}
    for name, message in errors.items():
        with pytest.raises(RewardError) as raised:
            score(resolve_rewards([RewardConfig(f"user_rewards:{name}")], GenerationConfig()), rollouts)
        assert str(raised.value).startswith(message) and "\n" not in str(raised.value), raised.value
    for function, message in (("nowhere:fn", "cannot import nowhere"), ("user_rewards:absent", "has no function"),
                              ("exact", "unknown reward function 'exact'")):
        with pytest.raises(ConfigError, match=message):
            resolve_rewards([RewardConfig(function)], GenerationConfig())


# ---- runs: generate, score, update -----------------------------------------------------------------------------------

def generate_with_stops(info, model_dir: Path) -> dict:
    """The ranks generate for different prompts with a stop string, so rows and ranks stop at different tokens:
    the sharded model's all-gathers stay in step (synced_gpus) and every rank returns. The first forward the model
    ever runs is the split layout's (as a run's first step generates first): the update's backward after it must
    find the ranks' gathers in step."""
    from qlora_fsdp.generation.layouts import split_extra_bytes
    from qlora_fsdp.generation.room import gathered_extra_bytes
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.objectives.rollouts import generate

    cfg = tiny_config(model_dir)
    tokenizer = load_tokenizer(cfg)
    model = build_sharded_model(cfg, info)
    torch.manual_seed(info.rank)
    prompt = tokenizer(["Reverse the letters of the word.", "How many words are in the text?"][info.rank])
    grpo = generation_plan(num_generations=4, max_completion_length=12, stop=["e"], rows=3)  # calls of 3, 1
    made = generate(model, tokenizer, [prompt["input_ids"]], grpo, info.device, info.world_size, layout="split")
    texts = [tokenizer.decode(ids) for ids in made.ids]
    return {"update_grads": backward_of(model, prompt["input_ids"], made.ids, tokenizer.pad_token_id, info),
            "lengths": [len(ids) for ids in made.ids], "texts": texts, "truncated": made.truncated,
            "eos": tokenizer.eos_token_id, "ids": made.ids, "training": model.training,
            "gathered": bytes_gathered_by_layout(model, tokenizer, [prompt["input_ids"]], info),
            "extra": (gathered_extra_bytes(model), split_extra_bytes(model, info.rank, info.world_size)),
            "graphs": greedy_with_and_without_graphs(model, tokenizer, [prompt["input_ids"]], info),
            "logps": generated_and_recomputed_logps(model, tokenizer, [prompt["input_ids"]], info)}


def backward_of(model, prompt: list[int], completions: list[list[int]], pad: int, info) -> int:
    """The update's forward and backward over the completions: how many LoRA parameters got a gradient."""
    from qlora_fsdp.data.batching import collate
    from qlora_fsdp.losses.forward import ForwardLoss
    from qlora_fsdp.objectives.grpo import completion_sample

    batch = collate([completion_sample(prompt, ids, False) for ids in completions], pad)
    ForwardLoss()(model, batch, info.device).backward()
    graded = sum(p.grad is not None for name, p in model.named_parameters() if "lora_" in name)
    model.zero_grad(set_to_none=True)
    return graded


def generated_and_recomputed_logps(model, tokenizer, prompts: list[list[int]], info) -> dict:
    """Each sampled token's log-probability as generation saw it (KV cache, left padding, the generation kernel)
    and as the update recomputes it (the completion after its prompt, the training kernel), at the temperature."""
    from qlora_fsdp.data.batching import collate
    from qlora_fsdp.losses.forward import ForwardLoss
    from qlora_fsdp.objectives.grpo import completion_sample
    from qlora_fsdp.objectives.rollouts import generate

    grpo = generation_plan(num_generations=3, max_completion_length=8, temperature=0.7)
    torch.manual_seed(3 + info.rank)
    made = generate(model, tokenizer, prompts, grpo, info.device, info.world_size, logps=True)
    samples = [completion_sample(prompts[0], ids, False) for ids in made.ids]
    batch = collate(samples, tokenizer.pad_token_id)
    model.eval()  # no LoRA dropout, as in generation
    with torch.no_grad():
        flat = ForwardLoss().token_logps(model, batch, info.device, grpo.settings.temperature).logps
    model.train()
    pieces = flat.split(batch.targets_per_sample().tolist())
    return {"generated": made.logps, "recomputed": [piece.tolist() for piece in pieces]}


def greedy_with_and_without_graphs(model, tokenizer, prompts: list[list[int]], info) -> dict:
    """The decoding step compiled (the path a GPU replays as a CUDA graph; compiled for the CPU here) against eager:
    the same greedy completions, and graphs were compiled."""
    from torch._dynamo.utils import counters

    from qlora_fsdp.objectives import rollouts
    from qlora_fsdp.objectives.rollouts import generate

    out: dict = {}
    for graphs in ("off", "on"):
        before = counters["stats"]["unique_graphs"]
        grpo = generation_plan(num_generations=2, max_completion_length=6, graphs=graphs)
        out[graphs] = generate(model, tokenizer, prompts, grpo, info.device, info.world_size, greedy=True).ids
        out[f"{graphs}_graphs"] = counters["stats"]["unique_graphs"] - before

    def failing_backend(graph, example_inputs, **settings):  # a compiler that cannot compile this step
        raise RuntimeError("no kernel for this op")

    rollouts.GRAPHS_BACKEND, backend = failing_backend, rollouts.GRAPHS_BACKEND
    torch._dynamo.reset()
    try:  # the run goes on eagerly, says why once, and later calls do not try again
        grpo = generation_plan(num_generations=2, max_completion_length=6, graphs="on")
        out["fallback"] = generate(model, tokenizer, prompts, grpo, info.device, info.world_size, greedy=True).ids
        out["failure"] = list(rollouts.GRAPHS_FAILED)
        out["later"] = generate(model, tokenizer, prompts, grpo, info.device, info.world_size, greedy=True).ids
    finally:
        rollouts.GRAPHS_BACKEND = backend
        rollouts.GRAPHS_FAILED.clear()
    return out


def bytes_gathered_by_layout(model, tokenizer, prompts: list[list[int]], info) -> dict:
    """Bytes FSDP2 all-gathers in a call of 2 and of 10 new tokens (no EOS or stop: rows run to the limit), per
    layout, and the model's sharded bytes: what a whole gather of it moves."""
    import torch.distributed as dist

    from qlora_fsdp.generation.layouts import LAYOUTS
    from qlora_fsdp.objectives.rollouts import generate

    counted = [0]
    all_gather = getattr(dist, FSDP2_ALL_GATHER)

    def counting(output, *args, **kwargs):
        counted[0] += output.numel() * output.element_size()
        return all_gather(output, *args, **kwargs)

    out: dict = {"model": sum(p.numel() * p.element_size() for p in model.parameters())}
    setattr(dist, FSDP2_ALL_GATHER, counting)
    try:
        for layout in LAYOUTS:
            for new in (2, 10):
                counted[0] = 0
                grpo = generation_plan(num_generations=2, max_completion_length=new, rows=1)  # calls of a row
                generate(model, tokenizer, prompts, grpo, info.device, info.world_size, layout)
                out[layout, new] = counted[0]
    finally:
        setattr(dist, FSDP2_ALL_GATHER, all_gather)
    return out


@pytest.mark.old_torch  # run on torch 2.11 too (make test-old-torch)
@pytest.mark.slow
def test_two_ranks_whose_generations_end_apart_stay_in_step_and_sample_what_they_update(tiny_model_dir, tmp_path):
    ranks = run_ranks(generate_with_stops, 2, tiny_model_dir, tmp_dir=tmp_path)
    for made in ranks:
        assert len(made["lengths"]) == 4 and made["training"] and made["update_grads"] >= 8
        for text, ids, cut in zip(made["texts"], made["ids"], made["truncated"], strict=True):
            # cut only at 12 tokens without EOS or the stop string; a row that stopped before 12 was not cut
            assert cut == (len(ids) == 12 and made["eos"] not in ids and not text.endswith("e")), (text, ids)
    assert {tuple(r["lengths"]) for r in ranks} != {(12,) * 4}  # the stop string ended rows early
    for logps in (r["logps"] for r in ranks):  # what the update recomputes is what generation sampled from
        assert [len(g) for g in logps["generated"]] == [len(r) for r in logps["recomputed"]]
        for generated, recomputed in zip(logps["generated"], logps["recomputed"], strict=True):
            assert torch.tensor(generated) == pytest.approx(torch.tensor(recomputed), abs=1e-5)
    for graphs in (r["graphs"] for r in ranks):
        assert graphs["on"] == graphs["off"] and graphs["on_graphs"] > 0 and graphs["off_graphs"] == 0, graphs
        assert graphs["fallback"] == graphs["later"] == graphs["off"]
        assert len(graphs["failure"]) == 1 and "no kernel for this op" in graphs["failure"][0]
    # gathered and split move the model once a step (its two calls of a row share the layout), whatever the
    # tokens; per token, once a decoding step
    # what `auto` asks of each layout (generation/plan.py's rule): a rank's split share of the layers is a strict
    # part of the whole model's, and the root (embeddings, head) is gathered by both ranks
    (whole, first), (_, second) = ranks[0]["extra"], ranks[1]["extra"]
    assert first + second > whole > max(first, second) > 0
    for gathered in (r["gathered"] for r in ranks):
        for layout in ("gathered", "split"):
            assert gathered[layout, 2] == gathered[layout, 10] == gathered["model"], layout
        assert gathered["per_token", 10] > 3 * gathered["per_token", 2] > 6 * gathered["model"]


@pytest.mark.slow  # not on torch 2.11: it runs the generation and update above, for 30 steps
def test_a_run_learns_from_its_rewards_on_two_ranks(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    # seed 1: with the held-out rule text data has (a tenth at most; 8 of these 500 prompts), seed 42's order of
    # prompts leaves this 2-layer model at a mean reward of 0.05 after 30 steps; seeds 1 to 4 reach 0.46 to 0.55
    results = run_cli(["--recipe", "tiny_cpu_grpo", f"model.path={tiny_model_dir}", f"train.output_dir={out}",
                       "train.max_steps=30", "logging.plot=false", "train.seed=1"], 2, tmp_path)
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    first, last = (sum(r["reward"] for r in part) / len(part) for part in (steps[:10], steps[-10:]))
    print(f"GRPO tiny_cpu_grpo: mean reward steps 1-10 {first:.3f}, 21-30 {last:.3f}")
    assert first < 0.1 and last > 0.25, (first, last)
    assert all(r["completion_length"] <= 8 and 0 <= r["truncated_ratio"] <= 1 for r in steps)
    summary = next(r for r in records if r.get("event") == "summary")
    assert summary["samples"] == 30 * 2 * 2 * 8  # a step: 2 ranks x 2 prompts x 8 completions
    # the 8 held-out prompts (4 a rank), scored before and after: the policy learned beyond its training prompts
    print(f"held-out reward {summary['eval_reward_start']:.3f} -> {summary['eval_reward_end']:.3f}")
    assert summary["eval_reward_end"] > summary["eval_reward_start"] + 0.1
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    for key in ("reward_std", "rewards/examples.rewards:category_words/std", "completion_length_max",
                "generated_tokens_per_s", "clip_ratio_low", "clip_ratio_high", "entropy"):
        assert all(key in r for r in steps), key
    assert all(0 < r["entropy"] < math.log(512) for r in steps)  # nats, below the tiny vocabulary's uniform
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == list(range(1, 31))
    assert all(len(s["completions"]) == len(s["rewards"]) == 8 and s["prompt"] for s in samples)
    assert_merged_equals_peft(out / "adapter", tiny_model_dir, tmp_path / "merged")


def assert_merged_equals_peft(adapter: Path, model_dir: Path, merged_dir: Path) -> None:
    """A GRPO adapter is an adapter like any: PEFT loads it onto transformers' 4-bit model, and the merge gives
    those logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qlora_fsdp.loading.adapter import config_for_adapter
    from qlora_fsdp.tools.adapter_merge import merge_adapter
    from tests.helpers import transformers_nf4

    merge_adapter(config_for_adapter(adapter, None, []), adapter, merged_dir, "float32")
    input_ids = torch.tensor([[1, 20, 30, 40, 50, 60]])
    with torch.no_grad():
        base = transformers_nf4(model_dir)
        before = base(input_ids=input_ids).logits
        live = PeftModel.from_pretrained(base, adapter).eval()(input_ids=input_ids).logits
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)(input_ids=input_ids).logits
    assert (live - before).abs().max() > 1e-3  # the adapter moved the model: matching it means something
    assert (merged - live).abs().max() < 1e-4 * live.abs().max()


@pytest.mark.slow
def test_resumed_mid_generation_equals_the_uninterrupted_run_on_two_ranks(tiny_model_dir, tmp_path):
    """num_iterations 2 with a checkpoint at step 3 (the generation of step 3 is used once more at step 4) and the
    KL term: the resumed run updates on the saved completions, old and reference log-probabilities, and samples
    the next generations with the restored RNG: the same records and a byte-identical adapter. Also with the rows
    split over the two ranks (context parallel: the first rank's completions kept by both, the kept and reference
    log-probabilities gathered over the split)."""

    def steps(run: Path) -> list[tuple]:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["reward"], r["kl"], r["grad_norm"]) for r in records if "reward" in r]

    for name, split in (("whole", []), ("split", ["fsdp.context_parallel=2", "data.micro_batch_size=4"])):
        common = ["--recipe", "tiny_cpu_grpo", f"model.path={tiny_model_dir}", "logging.plot=false",
                  "train.max_steps=6", "grpo.num_iterations=2", "grpo.beta=0.04", "train.save_every=3", *split]
        full, part = tmp_path / f"{name}_full", tmp_path / f"{name}_part"
        assert [r.returncode for r in run_cli([*common, f"train.output_dir={full}"], 2, tmp_path)] == [0, 0]
        checkpoint = full / "checkpoints" / "step-000003"
        assert sorted(p.name for p in checkpoint.glob("rank*_state.pt")) == ["rank0_state.pt", "rank1_state.pt"]
        resumed = run_cli([*common, f"train.output_dir={part}", f"train.resume={checkpoint}"], 2, tmp_path)
        assert [r.returncode for r in resumed] == [0, 0], resumed[0].stderr[-2000:]
        assert steps(part) == steps(full)[3:] and len(steps(full)) == 6, name
        assert any(step[3] > 0 for step in steps(part)), name  # the KL term was live after the resume
        adapter = "adapter/adapter_model.safetensors"
        assert (part / adapter).read_bytes() == (full / adapter).read_bytes(), name


def test_prompt_data_errors_name_the_file_and_record(tiny_model_dir, tmp_path):
    from qlora_fsdp.data.prompts import load_prompt_data
    from qlora_fsdp.errors import DataError
    from qlora_fsdp.loading.checkpoint import load_tokenizer

    def config(path: Path, context: int = 64, **data):
        return tiny_config(tiny_model_dir, data={"path": str(path), "format": "prompt", "context_length": context,
                                                 "eval_samples": 1, **data},
                           train={"objective": "grpo"}, generation={"max_completion_length": 16})

    records = tmp_path / "prompts.jsonl"
    records.write_text("\n".join(json.dumps(r) for r in (
        {"prompt": "Name some colors.", "answer": "#### 1"},
        {"prompt": [{"role": "user", "content": "Name some animals."}], "answer": "#### 2"},
        {"prompt": "word " * 200, "answer": "#### 3"})) + "\n")
    tokenizer = load_tokenizer(config(records))
    with pytest.raises(DataError, match=r"prompts.jsonl record 3: the prompt has \d+ tokens, more than "
                                        r"data.context_length - generation.max_completion_length = 112"):
        load_prompt_data(tokenizer, config(records, context=128))
    data = load_prompt_data(tokenizer, config(records, context=512))
    assert len(data.train) + len(data.eval) == 3 and data.train.columns.keys() == {"answer"}
    chat = data.train.prompts + data.eval.prompts
    assert sum(isinstance(p, list) for p in chat) == 1  # the messages stay messages for the reward functions
    gsm8k = tmp_path / "gsm8k.jsonl"  # GSM8K's columns: the prompt is its question, `answer` reaches the rewards
    gsm8k.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"... #### {i + 1}"}) + "\n"
                             for i in range(3)))
    with pytest.raises(DataError, match=r"gsm8k.jsonl: GRPO reads a 'prompt' column \(or data.fields: "
                                        r"\{prompt: <column>\}\); the records have \['question', 'answer'\]"):
        load_prompt_data(tokenizer, config(gsm8k))
    mapped = load_prompt_data(tokenizer, config(gsm8k, fields={"prompt": "question"}))
    assert sorted(mapped.train.prompts + mapped.eval.prompts) == [f"What is {i} + 1?" for i in range(3)]
    assert mapped.train.columns.keys() == {"answer"}
    renamed = load_prompt_data(tokenizer, config(gsm8k, fields={"prompt": "question", "gold": "answer"}))
    assert renamed.train.columns.keys() == {"gold"}  # the rewards read it under the name the recipe gives
    with pytest.raises(DataError, match=r"gsm8k.jsonl: data.fields maps answer to a column 'solution' the records "
                                        r"lack; they have \['prompt', 'answer'\]"):
        load_prompt_data(tokenizer, config(gsm8k, fields={"prompt": "question", "answer": "solution"}))


# ---- the whole step against TRL: from generated ids to gradients ---------------------------------------------------

E2E_PROMPTS, E2E_GENERATIONS, E2E_MAX, E2E_LR = 4, 4, 7, 0.5
E2E_SETTINGS = {  # TRL's GRPOConfig keys, each ours too
    "group_dapo": dict(scale_rewards="group", loss_type="dapo"),
    "batch_bnpo_masked": dict(scale_rewards="batch", loss_type="bnpo", mask_truncated_completions=True),
    "none_grpo_two_iterations": dict(scale_rewards="none", loss_type="grpo", num_iterations=2),
}


def parity_reward(completion_ids, **kwargs) -> list[float]:
    """A reward read off the ids (the same on both sides): groups with different rewards, some ties."""
    return [float(len(ids) % 3) + 0.5 * (ids[0] % 2) for ids in completion_ids]


def e2e_rollouts(eos: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Prompts of different lengths and, per prompt, the rows a generator returns (max_completion_length tokens, as
    HF pads them): some end in EOS (padded after it), some run to the limit without (truncated), one ends in EOS at
    the limit (not truncated)."""
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(10, 500, (5 + 2 * p,), generator=generator).tolist() for p in range(E2E_PROMPTS)]
    return prompts, fixed_completions(eos, E2E_PROMPTS, E2E_GENERATIONS, E2E_MAX, generator)


def fixed_completions(eos: int, n_prompts: int, generations: int, max_new: int,
                      generator: torch.Generator) -> list[list[list[int]]]:
    """Per prompt, the rows a generator returns: some end in EOS, some run to max_new without (truncated), one may
    end in EOS at the limit (not truncated)."""
    rows = []
    for p in range(n_prompts):
        mine = []
        for g in range(generations):
            length = 1 + (3 * p + 5 * g) % max_new
            tokens = torch.randint(10, 500, (length,), generator=generator).tolist()
            ends = (p + g) % 3 != 0 or length < 3
            if ends:
                tokens[-1] = eos
            elif length < max_new:  # no EOS: the generator ran on to the limit
                tokens += torch.randint(10, 500, (max_new - length,), generator=generator).tolist()
            mine.append(tokens)
        rows.append(mine)
    return rows


def trl_cut(row: list[int], eos: int) -> list[int]:
    """A completion as TRL keeps one: through its first EOS."""
    return row[: row.index(eos) + 1] if eos in row else row


class ReplayedGenerate:
    """transformers' generate replaced by the rows fixed above: each prompt's next row, padded to the call's width
    (our whole rollout code runs around it: left padding, the EOS cut, the truncated flag)."""

    def __init__(self, prompts: list[list[int]], rows: list[list[list[int]]], pad: int) -> None:
        self.queue = {tuple(p): list(r) for p, r in zip(prompts, rows, strict=True)}
        self.pad = pad

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 **kwargs: object) -> torch.Tensor:
        new = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            row = self.queue[tuple(i for i, m in zip(ids, mask, strict=True) if m)].pop(0)
            new.append(row + [self.pad] * (max_new_tokens - len(row)))
        return torch.cat([input_ids, torch.tensor(new, device=input_ids.device)], dim=1)


def our_whole_step(info, model_dir: Path, adapter: Path, packed: bool) -> dict:
    """Each setting: our GRPO objective's generation (generate replaced), rewards, advantages and update, one
    prompt a micro-batch; with num_iterations 2, a second update on the same generation after an SGD step."""
    from qlora_fsdp.data.prompts import PromptData, Prompts
    from qlora_fsdp.distributed.row_groups import RowSplit
    from qlora_fsdp.loading.adapter import adapter_file_key, load_adapter_into
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.loading.fill import model_layout
    from qlora_fsdp.losses.forward import ForwardLoss
    from qlora_fsdp.objectives.base import RunParts
    from qlora_fsdp.objectives.grpo import Grpo
    from qlora_fsdp.rewards.functions import Reward

    out: dict = {}
    for name, setting in E2E_SETTINGS.items():
        cfg = tiny_config(model_dir, data={"packing": packed, "context_length": 64, "format": "prompt",
                                           "micro_batch_size": 1},
                          train={"objective": "grpo"})
        cfg = dataclasses.replace(cfg, grpo=GrpoConfig(**setting), generation=GenerationConfig(
            num_generations=E2E_GENERATIONS, max_completion_length=E2E_MAX, temperature=TEMPERATURE))
        tokenizer = load_tokenizer(cfg)
        model = build_sharded_model(cfg, info)
        load_adapter_into(model, adapter)
        model.train()
        prompts, rows = e2e_rollouts(tokenizer.eos_token_id)
        model.generate = ReplayedGenerate(prompts, rows, tokenizer.pad_token_id)
        texts = [f"prompt {p}" for p in range(E2E_PROMPTS)]
        data = PromptData(Prompts(prompts, texts, {}, list(range(E2E_PROMPTS))), Prompts([], [], {}, []), "")
        steps = Grpo(cfg, ForwardLoss(), rewards=[Reward("parity", parity_reward, 1.0)])
        steps.attach(RunParts(info, model, data, tokenizer.pad_token_id, None,
                              RowSplit(1, 0, info.rank, info.world_size), tokenizer))
        mine = range(info.rank * E2E_PROMPTS // info.world_size, (info.rank + 1) * E2E_PROMPTS // info.world_size)
        steps.current, steps.uses = steps.generate([[p] for p in mine]), 0
        layout = model_layout(model)
        results = []
        for _ in range(steps.grpo.num_iterations):
            result = steps.step(1.0)
            grads = {adapter_file_key(key, layout): grad for key, grad in full_grads(model).items()}
            results.append({"loss": result.loss, "grads": grads})
            with torch.no_grad():  # plain SGD on every rank's shard, the same step TRL's side takes
                for param in model.parameters():
                    if param.grad is not None:
                        param.add_(param.grad, alpha=-E2E_LR)
            model.zero_grad(set_to_none=True)
        out[name] = {"steps": results, "advantages": steps.current.advantages.tolist()}
    out["held_out"] = held_out_rewards(steps, model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return out


def held_out_rewards(steps: Any, model: torch.nn.Module, eos: int, pad: int) -> dict:
    """The objective's held-out evaluation of 3 prompts and of 1, generation replayed (at world size 2: a rank
    with one prompt fewer, then a rank with none): per count, the metrics, this rank's generate calls, and the
    reward's mean over the prompts' completions, each counted once."""
    from qlora_fsdp.data.prompts import PromptData, Prompts

    prompts, rows = e2e_rollouts(eos)
    out: dict = {}
    for n in (3, 1):
        replay = ReplayedGenerate(prompts, [mine + mine for mine in rows], pad)  # a repeated prompt replays again
        calls: list[int] = []

        def counted(*args: Any, replay: ReplayedGenerate = replay, calls: list[int] = calls, **kwargs: Any) -> Any:
            calls.append(1)
            return replay(*args, **kwargs)

        model.generate = counted
        held = Prompts(prompts[:n], [f"prompt {p}" for p in range(n)], {}, list(range(n)))
        steps.run = dataclasses.replace(steps.parts, data=PromptData(steps.data.train, held, ""))
        expected = [parity_reward([trl_cut(row, eos)])[0] for mine in rows[:n] for row in mine]
        out[n] = {"metrics": steps.evaluate(1), "calls": len(calls), "expected": sum(expected) / len(expected)}
    return out


def trl_whole_step(model_dir: Path, adapter: Path, tmp_path: Path) -> dict:
    """TRL 1.16's own _generate_and_score_completions (its generation replaced by rollout_func returning the same
    ids, cut as TRL cuts them) and compute_loss over the same micro-batches (TRL shuffles rows before splitting a
    generation into micro-batches; here they are taken in order, one prompt's completions each), accumulated."""
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tests.helpers import transformers_nf4

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.eos_token_id
    prompts, rows = e2e_rollouts(eos)
    texts = [f"prompt {p}" for p in range(E2E_PROMPTS)]
    by_text = dict(zip(texts, range(E2E_PROMPTS), strict=True))
    out: dict = {}

    def replay(queue: dict[int, list[list[int]]]):  # noqa: ANN202 (TRL's rollout_func)
        def rollout(batch: list[str], trainer: object) -> dict:
            picked = [by_text[text] for text in batch]
            made = [trl_cut(queue[p].pop(0), eos) for p in picked]
            return {"prompt_ids": [prompts[p] for p in picked], "completion_ids": made,
                    "logprobs": [[0.0] * len(ids) for ids in made]}
        return rollout

    for name, setting in E2E_SETTINGS.items():
        model = PeftModel.from_pretrained(transformers_nf4(model_dir), adapter, is_trainable=True)
        adapter_weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=E2E_GENERATIONS,
                          gradient_accumulation_steps=E2E_PROMPTS, num_generations=E2E_GENERATIONS,
                          max_completion_length=E2E_MAX, temperature=TEMPERATURE, beta=0.0, use_cpu=True,
                          bf16=False, report_to="none", gradient_checkpointing=False, **setting)
        trainer = GRPOTrainer(model=model, reward_funcs=[parity_reward], args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_list([{"prompt": t} for t in texts]),
                              rollout_func=replay({p: list(r) for p, r in enumerate(rows)}))
        for n, param in model.named_parameters():  # TRL casts a QLoRA adapter to bf16: fp32 here, as ours
            if n in adapter_weights:
                param.data = adapter_weights[n]
        trainer.current_gradient_accumulation_steps = E2E_PROMPTS
        model.train()
        batch = trainer._generate_and_score_completions([{"prompt": t} for t in texts for _ in range(E2E_GENERATIONS)])
        size = E2E_PROMPTS * E2E_GENERATIONS
        results = []
        for _ in range(args.num_iterations):
            loss, grads = trl_accumulated(trainer, model, batch, size, E2E_PROMPTS)
            results.append({"loss": loss, "grads": grads})
            with torch.no_grad():
                for param in model.parameters():
                    if param.grad is not None:
                        param.add_(param.grad, alpha=-E2E_LR)
            model.zero_grad(set_to_none=True)
        out[name] = {"steps": results, "advantages": batch["advantages"].tolist()}
    return out


def trl_accumulated(trainer: Any, model: Any, batch: dict, size: int, micro_batches: int) -> tuple[float, dict]:
    """TRL's compute_loss over a generation's rows in `micro_batches` equal parts, in order, backpropagated one by
    one: the summed loss and each LoRA gradient by PEFT's adapter-file key."""
    from qlora_fsdp.loading.adapter import peft_adapter_key

    loss = 0.0
    for part in torch.arange(size).chunk(micro_batches):
        micro = {k: v[part] if isinstance(v, torch.Tensor) and v.dim() and len(v) == size else v
                 for k, v in batch.items()}
        micro_loss = trainer.compute_loss(model, micro)
        micro_loss.backward()
        loss += micro_loss.item()
    return loss, {peft_adapter_key(n, "default"): p.grad.detach().clone() for n, p in model.named_parameters()
                  if p.requires_grad}


@pytest.mark.slow
def test_the_whole_step_from_generated_ids_equals_trls(tmp_path):
    """From the ids a generator returned to the LoRA gradients: TRL's _generate_and_score_completions and
    compute_loss against our objective's generation, rewards, advantages and update, at world sizes 1 (padded rows)
    and 2 (packed rows): scale_rewards group, batch and none, truncated completions masked, num_iterations 2 (the
    second update on the kept generation after an SGD step), bnpo per micro-batch."""
    model_dir = build_tiny_checkpoint(tmp_path / "model")
    adapter = run_ranks(our_update, 1, model_dir, None, None, False, ("dapo_token",), tmp_dir=tmp_path)[0]["adapter"]
    one = run_ranks(our_whole_step, 1, model_dir, adapter, False, tmp_dir=tmp_path)[0]
    two_ranks = run_ranks(our_whole_step, 2, model_dir, adapter, True, tmp_dir=tmp_path)
    two = two_ranks[0]
    # held-out prompts fewer than, and not a multiple of, the ranks: each scored once, every rank generating as often
    for n in (3, 1):
        alone, ranks = one["held_out"][n], [r["held_out"][n] for r in two_ranks]
        assert alone["metrics"]["eval_reward"] == pytest.approx(alone["expected"], abs=1e-9), n
        assert ranks[0]["calls"] == ranks[1]["calls"] > 0, n
        for rank in ranks:
            assert rank["metrics"] == pytest.approx(alone["metrics"], abs=1e-9), n
    trl = trl_whole_step(model_dir, adapter, tmp_path)
    for name in E2E_SETTINGS:
        reference = trl[name]
        assert len(set(reference["advantages"])) > 3  # rewards that differ within groups
        for size, run in ((1, one), (2, two)):
            ours = run[name]
            local = len(ours["advantages"])  # rank 0's completions: the first of TRL's
            assert ours["advantages"] == pytest.approx(reference["advantages"][:local], abs=1e-6), (name, size)
            assert len(ours["steps"]) == len(reference["steps"]) == E2E_SETTINGS[name].get("num_iterations", 1)
            for step, (mine, theirs) in enumerate(zip(ours["steps"], reference["steps"], strict=True)):
                print(f"{name} ws{size} update {step + 1}: TRL {theirs['loss']:.7f}, ours {mine['loss']:.7f}")
                assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6), (name, size, step)
                assert mine["grads"].keys() == theirs["grads"].keys()
                for key, grad in theirs["grads"].items():
                    assert relative(mine["grads"][key], grad) < 1e-5, (name, size, step, key)
