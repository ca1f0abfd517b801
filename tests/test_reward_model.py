"""Reward models (train.objective reward) on the 4-bit, sharded base: the Bradley-Terry loss (with TRL's margin and
centering), each sequence's score and every gradient equal TRL 1.16's RewardTrainer on transformers + bitsandbytes
with the same adapter and head; k micro-batches and two ranks equal one batch; the saved adapter is PEFT's
sequence-classification adapter and scores alike under PEFT; merge refuses it in one line."""

from __future__ import annotations

import json

import pytest
import torch

from qlora_fsdp.commands.merge import main as merge_main
from qlora_fsdp.config import to_yaml
from qlora_fsdp.data.batching import collate_packed
from qlora_fsdp.data.pair_pipeline import load_pairs
from qlora_fsdp.data.pipeline import Dataset
from qlora_fsdp.loading.adapter import export_adapter
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.loading.placement import copy_full_into
from qlora_fsdp.objectives.pair_steps import accumulate_pairs, pair_rows, with_pair_extras
from tests.helpers import (
    REPO,
    assert_close_to_summation_order,
    command_here,
    full_grads,
    rank_units,
    recipe_pair_loss,
    relative_difference,
    run_cli,
    run_ranks_sequence,
    split_parts,
    tiny_config,
    transformers_nf4,
)
from tests.test_kto import set_adapter

pytestmark = pytest.mark.slow  # gloo ranks

N_PAIRS = 8
CENTER = 0.01
# a score's longest sum: the tiny model's MLP (intermediate size 256; a sequence's attention spans fewer tokens).
# Ours (packed rows, split rows) and PEFT's or TRL's (padded or alone) sum in other orders: 3e-6 seen at scores of 2.6
SCORE_SUMS = 256


def pairs_with_margins(path):
    """The first shipped preference pairs, with TRL's `margin` column (one pair without it)."""
    lines = (REPO / "data" / "tiny_preferences.jsonl").read_text().splitlines()[:N_PAIRS + 8]
    records = [json.loads(line) for line in lines]
    for index, record in enumerate(records[1:], 1):
        record["margin"] = 0.25 * (index % 4)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def reward_config(model_dir, data_path, fsdp=None):
    cfg = tiny_config(model_dir, data={"path": str(data_path), "format": "chat", "context_length": 160,
                                       "eval_samples": 4},
                      train={"objective": "reward"}, preference={"center_rewards_coefficient": CENTER},
                      fsdp=fsdp or {})
    cfg.lora.dropout = 0.0
    return cfg


def set_reward_model(model) -> None:
    """LoRA (set_adapter's pattern) and the head set to fixed values, the same whatever the sharding."""
    set_adapter(model)
    for name, parameter in model.named_parameters():
        if ".score." in name and parameter.requires_grad:  # ours, or PEFT's modules_to_save copy
            copy_full_into(parameter, 0.3 * torch.sin(torch.arange(parameter.numel(), dtype=torch.float32) + 1).view(
                parameter.shape))


def training_pairs(cfg):
    data = load_pairs(load_tokenizer(cfg), cfg)
    ids = list(range(N_PAIRS))
    return pair_rows(data.samples(data.train, ids)), Dataset.pair_extras(data.train)


def reward_step(info, cfg, per_batch: int, adapter_dir=None):
    """One accumulated step over this rank's share of the first pairs: loss, metrics, gradients, every sequence's
    score; with `adapter_dir`, the adapter saved there too."""
    model = build_sharded_model(cfg, info)
    set_reward_model(model)
    rows, extras = training_pairs(cfg)
    pad_id = load_tokenizer(cfg).pad_token_id
    mine = rank_units(N_PAIRS, cfg, info.rank, info.world_size)
    batches = split_parts([with_pair_extras(collate_packed([rows[i] for i in mine[s : s + per_batch]], pad_id), extras,
                                            mine[s : s + per_batch]) for s in range(0, len(mine), per_batch)],
                          cfg, info.rank, pad_id)
    loss = recipe_pair_loss(cfg, info.device)
    with torch.no_grad():
        scores = torch.cat([loss.forward.sequence_rewards(model, b, info.device) for b in batches])
    result = accumulate_pairs(model, batches, info.device, loss)
    if adapter_dir is not None:
        export_adapter(model, load_tokenizer(cfg), adapter_dir, cfg.model.path, info.is_main, to_yaml(cfg))
    return {"loss": result.loss, "metrics": result.metrics, "grads": full_grads(model), "scores": scores,
            "pairs": mine}


def trl_reward_step(model_dir, cfg) -> dict:
    """TRL's RewardTrainer on the same pairs' tokens and margins: its collator and loss, on transformers + bitsandbytes
    NF4 (AutoModelForSequenceClassification, one label) with the same LoRA and head."""
    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    tokenizer = load_tokenizer(cfg)
    rows, extras = training_pairs(cfg)
    examples = [{"chosen_ids": chosen.input_ids, "rejected_ids": rejected.input_ids, "margin": extras["margin"][i]}
                for i, (chosen, rejected) in enumerate(rows)]
    base = transformers_nf4(model_dir, AutoModelForSequenceClassification, unquantized=["score"], num_labels=1)
    base.config.pad_token_id = tokenizer.pad_token_id
    tiny = datasets.Dataset.from_list([{"chosen": "a", "rejected": "b"}] * 2)
    args = RewardConfig(output_dir=str(REPO / "outputs" / "trl_reward_test"), center_rewards_coefficient=CENTER,
                        per_device_train_batch_size=N_PAIRS, gradient_checkpointing=False, report_to=[], bf16=False,
                        use_cpu=True, max_length=None)
    trainer = RewardTrainer(model=base, args=args, train_dataset=tiny, processing_class=tokenizer,
                            peft_config=LoraConfig(task_type="SEQ_CLS", r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                   target_modules="all-linear", lora_dropout=0.0))
    model = trainer.model
    for param in model.parameters():  # TRL may keep a 4-bit model's adapter in bf16; ours is fp32
        if param.requires_grad:
            param.data = param.data.float()
    set_reward_model(model)
    model.train()
    loss, outputs = trainer.compute_loss(model, trainer.data_collator(examples), return_outputs=True)
    loss.backward()
    grads = {name.replace("modules_to_save.default.", ""): p.grad.detach().clone()
             for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "scores": outputs.logits.squeeze(-1).detach(), "grads": grads,
            "accuracy": trainer._metrics["train"]["accuracy"][-1], "margin": trainer._metrics["train"]["margin"][-1]}


def peft_scores(model_dir, adapter_dir, cfg) -> torch.Tensor:
    """Our saved adapter loaded by PEFT onto transformers' sequence classifier: each sequence's score."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    base = transformers_nf4(model_dir, AutoModelForSequenceClassification, unquantized=["score"], num_labels=1)
    base.config.pad_token_id = load_tokenizer(cfg).pad_token_id
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    rows, _ = training_pairs(cfg)
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([s.input_ids])).logits[0, 0] for row in rows for s in row])


@pytest.fixture(scope="module")
def reward_runs(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("reward")
    cfg = reward_config(tiny_model_dir, pairs_with_margins(work / "pairs.jsonl"))
    one, accumulated = run_ranks_sequence([(reward_step, (cfg, N_PAIRS)), (reward_step, (cfg, 2))], 1,
                                          tmp_path_factory.mktemp("reward1"))
    split_cfg = reward_config(tiny_model_dir, work / "pairs.jsonl", fsdp={"context_parallel": 2})
    sharded, split = run_ranks_sequence([(reward_step, (cfg, 2, work / "adapter")), (reward_step, (split_cfg, 2))], 2,
                                        tmp_path_factory.mktemp("rw2"))
    return {"cfg": cfg, "one": one, "accumulated": accumulated, "sharded": sharded, "split": split,
            "adapter": work / "adapter"}


def test_reward_model_equals_trls_reward_trainer_and_accumulates_and_shards_exactly(tiny_model_dir, reward_runs):
    trl = trl_reward_step(tiny_model_dir, reward_runs["cfg"])
    one = reward_runs["one"]
    chosen, rejected = one["scores"][0::2], one["scores"][1::2]
    assert_close_to_summation_order(chosen, trl["scores"][:N_PAIRS], SCORE_SUMS)
    assert_close_to_summation_order(rejected, trl["scores"][N_PAIRS:], SCORE_SUMS)
    assert (chosen - rejected).abs().min() > 1e-3  # the set head scores the two sides apart
    assert one["loss"] == pytest.approx(trl["loss"], rel=1e-5)
    assert one["metrics"]["reward_margin"] == pytest.approx(trl["margin"], rel=1e-5)
    assert one["metrics"]["reward_accuracy"] == pytest.approx(trl["accuracy"], abs=1e-6)
    ours = {name.replace("_checkpoint_wrapped_module.", ""): grad for name, grad in one["grads"].items()}
    assert ours.keys() == trl["grads"].keys() and "base_model.model.score.weight" in ours
    assert relative_difference(ours, trl["grads"]) <= 1e-5
    for other in ("accumulated", "sharded", "split"):
        run = reward_runs[other]
        assert run["loss"] == pytest.approx(one["loss"], rel=1e-5), other
        assert relative_difference(run["grads"], one["grads"]) <= 1e-5, other
    # rows split over two ranks (context parallel): each score from the rank holding its sequence's last token
    assert_close_to_summation_order(reward_runs["split"]["scores"], one["scores"], SCORE_SUMS)
    assert reward_runs["split"]["metrics"] == pytest.approx(one["metrics"], rel=1e-5, abs=1e-7)


def test_the_saved_reward_adapter_is_peft_sequence_classification(tiny_model_dir, reward_runs, tmp_path):
    """Its config and keys are PEFT's SEQ_CLS adapter's (the head in modules_to_save): PEFT loads it onto
    transformers' classifier and scores every sequence as we do; merge refuses it in one line."""
    adapter = reward_runs["adapter"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    scores = peft_scores(tiny_model_dir, adapter, reward_runs["cfg"])
    assert_close_to_summation_order(scores, reward_runs["one"]["scores"], SCORE_SUMS)
    merged = command_here(merge_main, ["--adapter", adapter, "--out", tmp_path / "merged"])
    errors = [line for line in merged.stderr.splitlines() if line.startswith("error: ")]
    assert merged.returncode == 2 and len(errors) == 1
    assert "is a reward model's adapter (task_type SEQ_CLS)" in errors[0]
    assert not (tmp_path / "merged").exists()


def test_grpo_scores_completions_with_the_trained_reward_model(tiny_model_dir, reward_runs, tmp_path):
    """`grpo.rewards: [{function: reward_model, options: {adapter: ...}}]`: resolved as GRPO resolves its rewards,
    it scores prompt + completion (GRPO's chat shape) as PEFT's classifier scores that text under the run's
    template; a folder that is no reward model's is refused in one line."""
    from qlora_fsdp.config import GenerationConfig, RewardConfig
    from qlora_fsdp.data.pipeline import run_template
    from qlora_fsdp.data.templates import encode
    from qlora_fsdp.errors import ConfigError
    from qlora_fsdp.objectives.reward_model_scores import as_messages, reward_model_function
    from qlora_fsdp.rewards.functions import resolve_rewards

    adapter, cfg = reward_runs["adapter"], reward_runs["cfg"]
    rewards = [RewardConfig(function="reward_model", options={"adapter": str(adapter)})]
    (reward,) = resolve_rewards(rewards, GenerationConfig(), "grpo", {"reward_model": reward_model_function})
    records = [json.loads(line) for line in (REPO / "data" / "tiny_preferences.jsonl").read_text().splitlines()[:3]]
    prompts = [r["prompt"] for r in records]
    completions = [r["chosen"] for r in records]
    ours = torch.tensor(reward.function(prompts=prompts, completions=completions))

    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    tokenizer = load_tokenizer(cfg)
    base = transformers_nf4(tiny_model_dir, AutoModelForSequenceClassification, unquantized=["score"], num_labels=1)
    base.config.pad_token_id = tokenizer.pad_token_id
    model = PeftModel.from_pretrained(base, adapter).eval()
    template = run_template(cfg.data, tokenizer)
    with torch.no_grad():
        theirs = torch.stack([model(input_ids=torch.tensor([encode(as_messages(p, "user") + as_messages(
            c, "assistant"), tokenizer, template, False)[0]])).logits[0, 0] for p, c in zip(prompts, completions,
                                                                                          strict=True)])
    assert_close_to_summation_order(ours, theirs, SCORE_SUMS)
    with pytest.raises(ConfigError, match="is not a reward model's adapter"):
        sft = tmp_path / "sft"
        sft.mkdir()
        (sft / "adapter_config.json").write_text(json.dumps({"task_type": "CAUSAL_LM"}))
        (sft / "training_config.yaml").write_text("")
        reward_model_function({"adapter": str(sft)})


def test_a_reward_run_through_train_py_learns_and_saves_its_adapter(tiny_model_dir, reward_runs, tmp_path):
    """train.py with train.objective reward on two ranks (the pairs' margins carried to their batches, held-out
    pairs scored): held-out reward accuracy rises over a few steps, and the adapter is PEFT's SEQ_CLS one."""
    out = tmp_path / "run"
    data = reward_runs["cfg"].data.path  # the pairs with margins
    results = run_cli(["--recipe", "tiny_cpu_dpo", f"model.path={tiny_model_dir}", "train.objective=reward",
                       f"data.path={data}", "data.eval_samples=4", "train.max_steps=6", "optim.lr=5e-3",
                       f"train.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}"], 2, tmp_path)
    assert results[0].returncode == 0, results[0].stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = records[-1]
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    start, end = summary["eval_reward_accuracy_start"], summary["eval_reward_accuracy_end"]
    print(f"held-out reward accuracy {start} -> {end}")
    assert end > start, (start, end)
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
