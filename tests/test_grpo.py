"""GRPO (train.objective grpo): the update against TRL 1.16's GRPOTrainer on transformers + bitsandbytes + PEFT,
rewards, advantages, and a run that generates, scores and updates at world sizes 1 and 2.

The update: fixed completions of fixed prompts (some ending in EOS, some cut at max_completion_length), the same
advantages, old and reference log-probabilities on both sides; TRL's `compute_loss` on its own 4-bit model with
the adapter loaded by PEFT (one process, the whole batch: TRL's one big batch) against ours at world size 1 (two
micro-batches, padded rows) and 2 (a micro-batch a rank, packed rows): the loss and every LoRA gradient, for the
four loss types, token and sequence (GSPO) ratios, clipping both sides, delta, the KL term and truncated
completions masked.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from qlora_fsdp.config import GrpoConfig
from qlora_fsdp.losses.policy import group_advantages
from tests.helpers import build_tiny_checkpoint, decoder_lora_keys, full_grads, run_ranks, tiny_config

PROMPTS, GENERATIONS, PROMPT_LENGTH = 4, 2, 6
TEMPERATURE = 0.7
# TRL's settings, each a GrpoConfig of ours with the same meaning
SETTINGS = {
    "dapo_token_kl_clip_higher": dict(loss_type="dapo", beta=0.04, epsilon_high=0.28),
    "grpo_sequence_delta": dict(loss_type="grpo", importance_sampling_level="sequence", delta=1.5),
    "dr_grpo_kl": dict(loss_type="dr_grpo", beta=0.1),
    "bnpo_masked_truncated": dict(loss_type="bnpo", mask_truncated_completions=True),
}
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


def grpo_settings(name: str) -> GrpoConfig:
    return GrpoConfig(num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE,
                      **SETTINGS[name])


def our_update(info, model_dir: Path, adapter: Path | None, old_ref: dict | None, packed: bool) -> dict:
    """Each setting's step loss and LoRA gradients on our model; world size 1 also writes the adapter (LoRA B
    seeded away from zero, so every LoRA tensor has a gradient) and returns the old and reference log-probabilities
    both sides then use (its own, moved by seeded noise so that ratios reach past the clip)."""
    from qlora_fsdp.loading.adapter import adapter_file_key, export_adapter, load_adapter_into
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.loading.factory import build_model
    from qlora_fsdp.loading.fill import model_layout
    from qlora_fsdp.losses.forward import ForwardLoss
    from qlora_fsdp.losses.policy import StepCounts
    from qlora_fsdp.training.grpo_steps import Generation, GrpoSteps, completion_sample

    cfg = tiny_config(model_dir, data={"packing": packed, "context_length": 64, "format": "prompt"},
                      train={"objective": "grpo"})
    tokenizer = load_tokenizer(cfg)
    model = build_model(cfg, info)
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
    mine = range(info.rank * PROMPTS // info.world_size, (info.rank + 1) * PROMPTS // info.world_size)
    rows = [p * GENERATIONS + g for p in mine for g in range(GENERATIONS)]
    advantages = group_advantages(torch.tensor([float(i % 5) for i in range(len(ids))]), GENERATIONS, "group")
    out: dict = {"adapter": adapter, "settings": {}}
    for name in SETTINGS:
        grpo = grpo_settings(name)
        masked = [grpo.mask_truncated_completions and truncated[i] for i in rows]
        samples = [completion_sample(prompts[i // GENERATIONS], ids[i], m) for i, m in zip(rows, masked, strict=True)]
        steps = GrpoSteps(dataclasses.replace(cfg, grpo=grpo), info, model, tokenizer, None, ForwardLoss(), [])
        if old_ref is None:  # our own log-probabilities, moved: both sides' old and reference
            noise = torch.Generator().manual_seed(1)
            current = steps.logps_by_completion(samples, list(range(len(samples))), adapter=True)
            old_ref = {kind: [lp + 0.3 * torch.randn(lp.shape, generator=noise) for lp in current]
                       for kind in ("old", "ref")}
            out["old_ref"] = old_ref
        tokens = sum(len(ids[i]) for i, m in zip(range(len(ids)), [grpo.mask_truncated_completions and t
                                                                   for t in truncated], strict=True) if not m)
        per = len(rows) // (2 if info.world_size == 1 else 1)
        kept = [old_ref["old"][i] if not m else old_ref["old"][i][:0] for i, m in zip(rows, masked, strict=True)]
        ref = [old_ref["ref"][i] if not m else old_ref["ref"][i][:0] for i, m in zip(rows, masked, strict=True)]
        steps.current = Generation(samples, [list(range(s, s + per)) for s in range(0, len(rows), per)],
                                   advantages[rows], kept, ref if grpo.beta else None,
                                   StepCounts(len(ids), tokens), {})
        result = steps.step(lambda: [])
        grads = {adapter_file_key(key, model_layout(model)): grad for key, grad in full_grads(model).items()}
        out["settings"][name] = {"loss": result.loss, "grads": grads}
        model.zero_grad(set_to_none=True)
    return out


def trl_update(model_dir: Path, adapter: Path, old_ref: dict) -> dict:
    """TRL's GRPOTrainer.compute_loss, one process, the whole batch, on transformers' 4-bit model + PEFT."""
    from accelerate import Accelerator
    from peft import PeftModel
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from qlora_fsdp.loading.adapter import peft_adapter_key
    from tests.helpers import transformers_nf4

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = transformers_nf4(model_dir)
    expected_keys = decoder_lora_keys(base)  # before PEFT wraps the modules
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
    for name, settings in SETTINGS.items():
        grpo = grpo_settings(name)
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
        if grpo.mask_truncated_completions:
            mask[torch.tensor(truncated)] = 0
        trainer = object.__new__(GRPOTrainer)
        trainer.args = GRPOConfig(output_dir=str(adapter.parent / "trl"), bf16=False, use_cpu=True, report_to="none",
                                  per_device_train_batch_size=rows, num_generations=GENERATIONS,
                                  gradient_checkpointing=False, **{k: v for k, v in settings.items()
                                                                    if k in ("delta", "mask_truncated_completions")})
        trainer.accelerator, trainer.model = Accelerator(cpu=True), model
        for key, value in dict(top_entropy_quantile=1.0, importance_sampling_level=grpo.importance_sampling_level,
                               off_policy_mask_threshold=None, beta=grpo.beta, loss_type=grpo.loss_type,
                               epsilon_low=grpo.epsilon, epsilon_high=grpo.resolved_epsilon_high, use_vllm=False,
                               vllm_importance_sampling_correction=False, max_completion_length=MAX_COMPLETION,
                               current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False,
                               aux_loss_enabled=False,
                               _metrics={"train": defaultdict(list), "eval": defaultdict(list)}).items():
            setattr(trainer, key, value)

        def padded(per_completion: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([torch.cat([lp, lp.new_zeros(width - len(lp))]) for lp in per_completion])

        inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
                  "completion_ids": completion_ids, "completion_mask": mask, "advantages": advantages,
                  "num_items_in_batch": mask.sum(), "old_per_token_logps": padded(old_ref["old"]) * mask}
        if grpo.beta:
            inputs["ref_per_token_logps"] = padded(old_ref["ref"]) * mask
        model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        grads = {peft_adapter_key(n, "default"): p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.requires_grad}
        out["settings"][name] = {"loss": loss.item(), "grads": grads}
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


@pytest.mark.slow
def test_the_update_equals_trls_at_world_sizes_1_and_2(tmp_path):
    model_dir = build_tiny_checkpoint(tmp_path / "model")
    one = run_ranks(our_update, 1, model_dir, None, None, False, tmp_dir=tmp_path)[0]
    two = run_ranks(our_update, 2, model_dir, one["adapter"], one["old_ref"], True, tmp_dir=tmp_path)[0]
    trl = trl_update(model_dir, one["adapter"], one["old_ref"])
    assert len(trl["expected_keys"]) >= 8
    for name in SETTINGS:
        reference = trl["settings"][name]
        print(f"{name}: TRL {reference['loss']:.7f}, ours {one['settings'][name]['loss']:.7f} (ws1) "
              f"{two['settings'][name]['loss']:.7f} (ws2)")
        assert reference["grads"].keys() >= trl["expected_keys"]
        for run in (one, two):
            ours = run["settings"][name]
            assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-7), name
            assert ours["grads"].keys() == reference["grads"].keys(), name
            for key, grad in reference["grads"].items():
                assert relative(ours["grads"][key], grad) < 1e-5, (name, key)


# ---- advantages and rewards (in process) --------------------------------------------------------------------------

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
