"""DFT (train.objective dft): our accumulated step over two ranks equals TRL 1.16's own DFT loss
(SFTTrainer.compute_loss with loss_type="dft") on transformers + bitsandbytes + PEFT over the same records, loss
and every LoRA gradient; the chunked loss equals the full one; and it is not SFT's loss."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import (
    batches,
    full_grads,
    relative_difference,
    run_ranks_sequence,
    tiny_config,
    train_here,
    transformers_nf4,
    variable_length_samples,
)

pytestmark = pytest.mark.slow  # gloo ranks

PAD = 2
SAMPLES = 8


def our_dft_step(info, model_dir: Path, chunked: bool) -> dict:
    """This rank's half of the samples in two micro-batches: DFT's and SFT's step loss, DFT's LoRA gradients; rank 0
    writes the adapter (its B matrices seeded off zero, so every LoRA tensor has a gradient)."""
    from qlora_fsdp.loading.adapter import adapter_file_key, export_adapter
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.loading.fill import model_layout
    from qlora_fsdp.loading.placement import copy_full_into
    from qlora_fsdp.losses.forward import ForwardLoss
    from qlora_fsdp.objectives.supervised import accumulate_gradients
    from qlora_fsdp.objectives.table import build_objective

    cfg = tiny_config(model_dir, train={"objective": "dft"}, loss={"chunked": chunked, "chunk_tokens": 7})
    cfg.lora.dropout = 0.0
    model = build_sharded_model(cfg, info)
    generator = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            copy_full_into(param, torch.randn(param.shape, generator=generator) * 0.05)
    adapter = Path(cfg.train.output_dir).parent / "dft_adapter"
    export_adapter(model, load_tokenizer(cfg), adapter, cfg.model.path, info.is_main, "")
    samples = variable_length_samples(cfg, SAMPLES)
    half = SAMPLES // info.world_size
    mine = batches(samples[info.rank * half : (info.rank + 1) * half], half // 2, PAD)
    forward_loss = ForwardLoss.for_config(cfg, info.device)
    objective = build_objective(cfg, forward_loss)
    dft = accumulate_gradients(model, mine, info.device, objective.forward_loss)
    grads = {adapter_file_key(key, model_layout(model)): grad for key, grad in full_grads(model).items()}
    model.zero_grad(set_to_none=True)
    sft = accumulate_gradients(model, mine, info.device, forward_loss)
    return {"loss": dft.loss, "sft_loss": sft.loss, "grads": grads, "adapter": adapter, "samples": samples}


def trl_dft_step(model_dir: Path, adapter: Path, samples: list) -> dict:
    """TRL's SFTTrainer.compute_loss, loss_type dft, on transformers' 4-bit model + PEFT: the whole batch in one
    process, normalized by the batch's target tokens as TRL does (num_items_in_batch)."""
    from peft import PeftModel
    from trl import SFTConfig, SFTTrainer
    from trl.trainer.utils import add_fused_lm_head

    from qlora_fsdp.loading.adapter import peft_adapter_key

    base = transformers_nf4(model_dir)
    model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))  # as SFTTrainer asks
    model.train()
    length = max(len(s.input_ids) for s in samples)
    inputs = {"input_ids": torch.tensor([s.input_ids + [PAD] * (length - len(s.input_ids)) for s in samples]),
              "attention_mask": torch.tensor([[1] * len(s.input_ids) + [0] * (length - len(s.input_ids))
                                              for s in samples]),
              "labels": torch.tensor([s.labels + [-100] * (length - len(s.labels)) for s in samples])}
    trainer = object.__new__(SFTTrainer)
    trainer.args = SFTConfig(output_dir=str(adapter.parent / "trl"), bf16=False, use_cpu=True, report_to="none",
                             loss_type="dft")
    identity = SimpleNamespace(gather_for_metrics=lambda value: value, parallelism_config=None, num_processes=1)
    for key, value in dict(model=model, accelerator=identity, aux_loss_enabled=False, compute_loss_func=None,
                           label_smoother=None, _total_train_tokens=0, _tp_size=1, get_tp_size=lambda: 1,
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)}).items():
        setattr(trainer, key, value)
    targets = int((inputs["labels"] != -100).sum())
    loss = trainer.compute_loss(model, inputs, num_items_in_batch=targets)
    loss.backward()
    grads = {peft_adapter_key(n, "default"): p.grad.detach().clone() for n, p in model.named_parameters()
             if p.requires_grad}
    return {"loss": loss.item(), "grads": grads}


def test_dft_equals_trls_dft_loss_over_two_ranks_chunked_or_not(tiny_model_dir, tmp_path):
    full, chunked = run_ranks_sequence([(our_dft_step, (tiny_model_dir, False)),
                                        (our_dft_step, (tiny_model_dir, True))], 2, tmp_path)
    trl = trl_dft_step(tiny_model_dir, full["adapter"], full["samples"])
    print(f"DFT loss: ours {full['loss']:.7f} (chunked {chunked['loss']:.7f}), TRL {trl['loss']:.7f}; "
          f"SFT's {full['sft_loss']:.7f}")  # shown by pytest -s
    assert set(full["grads"]) == set(trl["grads"]) and len(trl["grads"]) > 4
    assert full["loss"] == pytest.approx(trl["loss"], rel=1e-5)
    assert relative_difference(full["grads"], trl["grads"]) <= 1e-4
    assert chunked["loss"] == pytest.approx(full["loss"], rel=1e-5)
    assert relative_difference(chunked["grads"], full["grads"]) <= 1e-5
    # the check can fail: each token weighted by its probability (< 1) is not SFT's loss
    assert full["loss"] < 0.5 * full["sft_loss"]


def test_the_dft_recipe_plans_trains_evaluates_and_logs(tiny_model_dir, tmp_path):
    """The shipped recipe through the command line, no edit beyond the objective's module and its table rows: its
    plan runs DFT's micro-step, a short run logs DFT's loss and SFT's held-out figures at the start and the end."""
    from qlora_fsdp.config import load_config
    from qlora_fsdp.measure.fake_step import planned_objective
    from qlora_fsdp.objectives.dft import token_probability

    assert planned_objective(load_config("tiny_cpu_dft")).forward_loss.token_weight is token_probability
    out = tmp_path / "dft"
    result = train_here(["--recipe", "tiny_cpu_dft", f"model.path={tiny_model_dir}", f"train.output_dir={out}",
                         "train.max_steps=4", "train.eval_every=2", "train.save_every=0", "data.eval_samples=8"])
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in records if "eval_loss_end" in r)
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    assert summary["eval_ppl_end"] == pytest.approx(math.exp(summary["eval_loss_end"]))
    steps = [r for r in records if "loss" in r and "lr" in r]
    assert len(steps) >= 2 and all(r["loss"] < summary["eval_loss_start"] for r in steps)  # the weighted loss
    assert any("eval_loss" in r and r.get("step") == 2 for r in records)
