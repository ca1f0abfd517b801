"""RLOO (train.objective rloo) against TRL 1.16's RLOOTrainer, from the ids a generator returned to the LoRA
gradients: TRL's own _generate_and_score_completions (its generation replaced by the same ids) and compute_loss on
transformers + bitsandbytes + PEFT, against our objective's generation, rewards, leave-one-out advantages and
sequence-level update at world sizes 1 (padded rows) and 2 (packed rows): the KL penalty in the reward, clipped
rewards, masked truncated completions, advantages normalized over every rank's, and a second update on a kept
generation after an SGD step (the ratio away from 1, clip-higher). Then the recipe's table line: a plan, and a
two-step run that logs the objective's metrics."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from qlora_fsdp.config import GenerationConfig, RewardConfig, RlooConfig
from tests.helpers import full_grads, run_ranks, tiny_config
from tests.test_grpo import (
    E2E_GENERATIONS,
    E2E_LR,
    E2E_MAX,
    E2E_PROMPTS,
    TEMPERATURE,
    ReplayedGenerate,
    e2e_rollouts,
    our_update,
    parity_reward,
    relative,
    trl_cut,
)

SETTINGS = {  # TRL's RLOOConfig keys, each ours too
    "kl_in_reward": dict(beta=0.05),
    "clipped_masked": dict(beta=0.05, reward_clip_range=[0.0, 2.0], mask_truncated_completions=True),
    "normalized_two_iterations": dict(beta=0.0, normalize_advantages=True, num_iterations=2, epsilon_high=0.28),
}


def our_rloo(info, model_dir: Path, adapter: Path, packed: bool) -> dict:
    """Each setting: our RLOO objective's generation (generate replaced), rewards, advantages and update, one prompt
    a micro-batch; with num_iterations 2, a second update on the same generation after an SGD step."""
    from qlora_fsdp.data.prompts import PromptData, Prompts
    from qlora_fsdp.distributed.row_groups import RowSplit
    from qlora_fsdp.loading.adapter import adapter_file_key, load_adapter_into
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.loading.fill import model_layout
    from qlora_fsdp.losses.forward import ForwardLoss
    from qlora_fsdp.objectives.base import RunParts
    from qlora_fsdp.objectives.table import build_objective
    from qlora_fsdp.rewards.functions import Reward

    out: dict = {}
    for name, setting in SETTINGS.items():
        cfg = tiny_config(model_dir, data={"packing": packed, "context_length": 64, "format": "prompt",
                                           "micro_batch_size": 1}, train={"objective": "rloo"})
        cfg = dataclasses.replace(cfg, rloo=RlooConfig(**setting), generation=GenerationConfig(
            num_generations=E2E_GENERATIONS, max_completion_length=E2E_MAX, temperature=TEMPERATURE))
        tokenizer = load_tokenizer(cfg)
        model = build_sharded_model(cfg, info)
        load_adapter_into(model, adapter)
        model.train()
        prompts, rows = e2e_rollouts(tokenizer.eos_token_id)
        model.generate = ReplayedGenerate(prompts, rows, tokenizer.pad_token_id)
        texts = [f"prompt {p}" for p in range(E2E_PROMPTS)]
        data = PromptData(Prompts(prompts, texts, {}, list(range(E2E_PROMPTS))), Prompts([], [], {}, []), "")
        steps: Any = build_objective(cfg, ForwardLoss())
        steps.given_rewards, steps.rewards = True, [Reward("parity", parity_reward, 1.0)]
        steps.attach(RunParts(info, model, data, tokenizer.pad_token_id, None,
                              RowSplit(1, 0, info.rank, info.world_size), tokenizer))
        mine = range(info.rank * E2E_PROMPTS // info.world_size, (info.rank + 1) * E2E_PROMPTS // info.world_size)
        steps.current, steps.uses = steps.generate([[p] for p in mine]), 0
        layout = model_layout(model)
        results = []
        for _ in range(cfg.rloo.num_iterations):
            result = steps.step(1.0)
            grads = {adapter_file_key(key, layout): grad for key, grad in full_grads(model).items()}
            results.append({"loss": result.loss, "grads": grads, "metrics": result.metrics})
            with torch.no_grad():  # plain SGD on every rank's shard, the same step TRL's side takes
                for param in model.parameters():
                    if param.grad is not None:
                        param.add_(param.grad, alpha=-E2E_LR)
            model.zero_grad(set_to_none=True)
        out[name] = {"steps": results, "advantages": steps.current.advantages.tolist()}
    return out


def trl_rloo(model_dir: Path, adapter: Path, tmp_path: Path) -> dict:
    """TRL 1.16's RLOOTrainer: _generate_and_score_completions with its _generate returning the same ids (cut as
    TRL cuts them), then compute_loss over the same micro-batches (one prompt's completions each, in order; TRL
    returns a micro-batch's mean, which its Trainer divides by the accumulation steps), accumulated."""
    from datasets import Dataset
    from peft import PeftConfig, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    from trl import RLOOConfig, RLOOTrainer

    from qlora_fsdp.loading.adapter import peft_adapter_key
    from tests.helpers import transformers_nf4

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.eos_token_id
    prompts, rows = e2e_rollouts(eos)
    texts = [f"prompt {p}" for p in range(E2E_PROMPTS)]
    by_text = dict(zip(texts, range(E2E_PROMPTS), strict=True))
    out: dict = {}
    for name, setting in SETTINGS.items():
        args = RLOOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=E2E_GENERATIONS,
                          gradient_accumulation_steps=E2E_PROMPTS, num_generations=E2E_GENERATIONS,
                          max_completion_length=E2E_MAX, temperature=TEMPERATURE, use_cpu=True, bf16=False,
                          report_to="none", gradient_checkpointing=False, **setting)
        # a base model and the adapter's LoRA config, so that TRL's reference is the base (the adapter disabled), as
        # ours is for a run that starts a fresh adapter; then the adapter's values, in float32 as ours
        trainer = RLOOTrainer(model=transformers_nf4(model_dir), reward_funcs=[parity_reward], args=args,
                              processing_class=tokenizer, peft_config=PeftConfig.from_pretrained(adapter),
                              train_dataset=Dataset.from_list([{"prompt": t} for t in texts]))
        model = trainer.model
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
        set_peft_model_state_dict(model, load_file(adapter / "adapter_model.safetensors"))
        queue = {p: list(r) for p, r in enumerate(rows)}

        def replayed(batch: list[str], queue: dict = queue) -> tuple:
            picked = [by_text[text] for text in batch]
            made = [trl_cut(queue[p].pop(0), eos) for p in picked]
            return [prompts[p] for p in picked], made, tokenizer.batch_decode(made, skip_special_tokens=True)

        trainer._generate = replayed
        model.train()
        batch = trainer._generate_and_score_completions([{"prompt": t} for t in texts for _ in range(E2E_GENERATIONS)])
        size, results = E2E_PROMPTS * E2E_GENERATIONS, []
        for _ in range(args.num_iterations):
            loss = 0.0
            for part in torch.arange(size).chunk(E2E_PROMPTS):
                micro = {k: v[part] if isinstance(v, torch.Tensor) and v.dim() and len(v) == size else v
                         for k, v in batch.items()}
                micro_loss = trainer.compute_loss(model, micro) / E2E_PROMPTS
                micro_loss.backward()
                loss += micro_loss.item()
            grads = {peft_adapter_key(n, "default"): p.grad.detach().clone() for n, p in model.named_parameters()
                     if p.requires_grad}
            results.append({"loss": loss, "grads": grads, "kl": trainer._metrics["train"].get("kl", [None])[-1]})
            with torch.no_grad():
                for param in model.parameters():
                    if param.grad is not None:
                        param.add_(param.grad, alpha=-E2E_LR)
            model.zero_grad(set_to_none=True)
        out[name] = {"steps": results, "advantages": batch["advantages"].tolist()}
    return out


@pytest.mark.slow
def test_rloo_equals_trls_rloo_trainer_at_world_sizes_1_and_2(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    from tests.helpers import build_tiny_checkpoint

    build_tiny_checkpoint(model_dir)
    adapter = run_ranks(our_update, 1, model_dir, None, None, False, ("dapo_token",), tmp_dir=tmp_path)[0]["adapter"]
    one = run_ranks(our_rloo, 1, model_dir, adapter, False, tmp_dir=tmp_path)[0]
    two = run_ranks(our_rloo, 2, model_dir, adapter, True, tmp_dir=tmp_path)[0]
    # TRL's side is one plain process: with a rank's variables left in this one by an earlier in-process run,
    # accelerate would start a gloo group of one and keep it (seen in CI: a later test could not make its own)
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    try:
        trl = trl_rloo(model_dir, adapter, tmp_path)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    for name in SETTINGS:
        reference = trl[name]
        assert len(set(reference["advantages"])) > 3  # rewards that differ within groups
        for size, run in ((1, one), (2, two)):
            ours = run[name]
            local = len(ours["advantages"])  # rank 0's completions: the first of TRL's
            assert ours["advantages"] == pytest.approx(reference["advantages"][:local], abs=1e-5), (name, size)
            assert len(ours["steps"]) == len(reference["steps"]) == SETTINGS[name].get("num_iterations", 1)
            for step, (mine, theirs) in enumerate(zip(ours["steps"], reference["steps"], strict=True)):
                print(f"{name} ws{size} update {step + 1}: TRL {theirs['loss']:.7f}, ours {mine['loss']:.7f}")
                assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6), (name, size, step)
                if theirs["kl"] is not None and step == 0:  # the logged KL at generation
                    assert mine["metrics"]["kl"] == pytest.approx(theirs["kl"], rel=1e-4, abs=1e-6), (name, size)
                assert mine["grads"].keys() == theirs["grads"].keys()
                # 1e-5; after an SGD step of lr 0.5 both sides' weights differ at float rounding, and the normalized
                # advantages (divided by a std of about 1) carry it: 1.2e-5 measured on the second update
                tolerance = 1e-5 if step == 0 else 3e-5
                for key, grad in theirs["grads"].items():
                    assert relative(mine["grads"][key], grad) < tolerance, (name, size, step, key)


def test_rloo_settings_are_refused_in_one_line():
    """What RLOO cannot take is named before anything loads: no reward, a reversed clip range, GRPO's tools."""
    from qlora_fsdp.config import Config
    from qlora_fsdp.config.validation import validate
    from qlora_fsdp.errors import ConfigError

    def refused(match: str, **rloo: Any) -> None:
        cfg = Config()
        cfg.train.objective, cfg.data.format, cfg.data.context_length = "rloo", "prompt", 512
        cfg.rloo = RlooConfig(**{"rewards": [RewardConfig("math_answer")], **rloo})
        with pytest.raises(ConfigError, match=match) as raised:
            if "tools" in match:
                cfg.grpo.tools = ["examples/agent_tools.py:calculate"]
            validate(cfg)
        assert "\n" not in str(raised.value)

    refused("needs reward functions: rloo.rewards", rewards=[])
    refused("'rloo.reward_clip_range' must be", reward_clip_range=[1.0, 0.0])
    refused("'rloo.beta' must be 0 or more", beta=-0.1)
    refused("'grpo.tools' and environments are GRPO's", beta=0.0)


@pytest.mark.old_torch  # it reaches the compiler (run on torch 2.11 too: make test-old-torch)
def test_an_rloo_recipe_trains_logs_its_metrics_and_resumes_from_its_run_card(tiny_model_dir, tmp_path):
    """recipes/tiny_cpu_rloo.yaml (its plan is among the recorded ones: tests/test_plan.py), two steps on one rank:
    RLOO's metrics logged each step and named in the start record, the run's card written; then `--resume-from` its
    checkpoint without --recipe takes the command from the card and runs a third step."""
    from qlora_fsdp.outputs.run_card import read_run_card
    from tests.helpers import run_cli

    out = tmp_path / "run"
    given = [f"model.path={tiny_model_dir}", f"train.output_dir={out}", "train.max_steps=2", "logging.plot=false",
             "data.eval_samples=0"]
    (ran,) = run_cli(["--recipe", "tiny_cpu_rloo", *given], 1, tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r and "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert records[0]["metrics"] == {"progress": ["reward", "kl"], "eval": ["eval_reward"]}  # what the plotters draw
    assert all(0 <= r["clip_ratio_low"] <= 1 and "kl" in r and "entropy" in r for r in steps), steps
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    card = read_run_card(out)
    assert card is not None and (card.recipe, card.overrides, card.world_size) == ("tiny_cpu_rloo", given, 1)
    assert card.output_dir == str(out.resolve()) and card.config["train"]["objective"] == "rloo"
    (resumed,) = run_cli(["--resume-from", str(out / "checkpoints" / "step-000002"), "train.max_steps=3"], 1,
                         tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "--recipe tiny_cpu_rloo and its overrides, from its run.json" in resumed.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward" in r and "loss" in r] == [1, 2, 3]
    assert read_run_card(out).overrides == [*given[:2], *given[3:], "train.max_steps=3"]
