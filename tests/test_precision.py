"""`auto` dtypes per device, and float16 training with dynamic loss scaling: an overflowing step is skipped and
counted, the scale backs off and grows again, no NaN or inf reaches a weight or the optimizer, and a resume is
bit-identical (the scaler's state is in the checkpoint)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from qlora_fsdp.commands.train import main
from qlora_fsdp.config import Config, HardwareConfig
from qlora_fsdp.distributed import cleanup
from qlora_fsdp.measure.fake_world import planning_mesh
from qlora_fsdp.measure.held import meta_held
from qlora_fsdp.measure.planning import Planning
from qlora_fsdp.objectives import supervised
from qlora_fsdp.precision import DeviceDescription, cpu_has_bf16, resolve_dtypes, uses_loss_scaling
from qlora_fsdp.run.accelerators import planned_device
from qlora_fsdp.training import loop
from qlora_fsdp.training.loss_scale import LossScaler
from tests.helpers import tiny_config

AUTO = {
    DeviceDescription("cuda", (9, 0)): "bfloat16",  # H100
    DeviceDescription("cuda", (8, 9)): "bfloat16",  # RTX 4090, L4, L40S
    DeviceDescription("cuda", (8, 6)): "bfloat16",  # RTX 3090, A6000
    DeviceDescription("cuda", (8, 0)): "bfloat16",  # A100
    DeviceDescription("cuda", (7, 5)): "float16",  # T4, RTX 20xx
    DeviceDescription("cuda", (7, 0)): "float16",  # V100
    DeviceDescription("cpu", cpu_bf16=True): "bfloat16",  # Sapphire Rapids (AMX), Zen 4 (AVX512-BF16)
    DeviceDescription("cpu", cpu_bf16=False): "float32",
}


@pytest.mark.parametrize("device", AUTO, ids=[f"{d.kind}-{d.capability}-{d.cpu_bf16}" for d in AUTO])
def test_auto_resolves_per_device(device):
    resolved = resolve_dtypes(Config(), device)
    assert resolved.model.dtype == resolved.quant.compute_dtype == AUTO[device]
    assert uses_loss_scaling(resolved) == (AUTO[device] == "float16")


def test_explicit_dtypes_are_kept_and_the_planner_resolves_for_the_recipes_gpu():
    cfg = Config()
    cfg.model.dtype = "float32"
    resolved = resolve_dtypes(cfg, DeviceDescription("cuda", (7, 5)))
    assert (resolved.model.dtype, resolved.quant.compute_dtype) == ("float32", "float16")
    assert planned_device(HardwareConfig(gpu="t4")).auto_dtype() == "float16"
    assert planned_device(HardwareConfig(gpu="v100-16gb")).auto_dtype() == "float16"
    assert planned_device(HardwareConfig(gpu="rtx4090")).auto_dtype() == "bfloat16"


def test_the_planner_counts_the_bytes_of_the_dtypes_auto_picks(tiny_model_dir):
    """Embeddings, norms and head in 2 bytes on a T4 (float16) and an RTX 4090 (bfloat16), in float32's 4 on a
    CPU without bf16 units."""
    cfg = tiny_config(tiny_model_dir, model={"dtype": "auto"}, quant={"compute_dtype": "auto"})
    try:
        mesh = planning_mesh(1)
        on = {gpu: Planning.of(dataclasses.replace(cfg, hardware=HardwareConfig(gpu=gpu)))
              for gpu in ("t4", "rtx4090", "cpu")}
        other = {gpu: meta_held(planning, mesh).other_base for gpu, planning in on.items()}
    finally:
        cleanup()
    assert other["t4"] == other["rtx4090"] > 0
    assert other["cpu"] == other["t4"] * (1 if cpu_has_bf16() else 2)


def test_cpu_bf16_units_are_read_from_the_flags():
    assert cpu_has_bf16("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile\n")
    assert cpu_has_bf16("flags\t\t: fpu avx512f amx_bf16 amx_tile\n")
    assert not cpu_has_bf16("flags\t\t: fpu sse avx2 avx512f avx512bw\n")  # AVX-512 alone is not bf16
    assert not cpu_has_bf16("")


def test_scaler_backs_off_grows_and_round_trips():
    scaler = LossScaler(True, 1024.0, growth_interval=2)
    assert [scaler.update(n) for n in (1.0, 2.0, math.inf, 1.0, math.nan, 1.0, 1.0)] == [
        False, False, True, False, True, False, False]
    assert scaler.scale == 1024.0 and scaler.overflows == 2 and scaler.good_steps == 0
    copy = LossScaler(True)
    copy.load_state_dict(json.loads(json.dumps(scaler.state_dict())))  # the checkpoint keeps it as JSON
    assert copy == scaler
    assert LossScaler(False).factor == 1.0 and not LossScaler(False).update(math.inf)


OVERFLOW_STEP = 3  # 1-based: the step whose backward overflows float16


@pytest.fixture
def overflow_injected(monkeypatch):
    """The trainers of the runs, with step OVERFLOW_STEP's backward pushed past float16's range: the loss factor
    times 1e30 stays finite in float32, and overflows to inf where it meets the float16 activations."""
    trainers, armed = [], [False]
    original_step, original_backward = loop.Trainer.train_step, supervised.backward_micro_batch

    def train_step(self):
        if self not in trainers:
            trainers.append(self)
        armed[0] = self.step + 1 == OVERFLOW_STEP
        return original_step(self)

    def backward(model, batch, device, normalizer, forward_loss, loss_factor=1.0):
        return original_backward(model, batch, device, normalizer, forward_loss,
                                 loss_factor * (1e30 if armed[0] else 1.0))

    monkeypatch.setattr(loop.Trainer, "train_step", train_step)
    monkeypatch.setattr(supervised, "backward_micro_batch", backward)
    return trainers


def metrics(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss_scale" in r]


def all_finite(trainer) -> bool:
    tensors = [p.detach() for p in trainer.model.parameters() if p.requires_grad]
    tensors += [v for state in trainer.optimizer.inner.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return bool(tensors) and all(torch.isfinite(t.float()).all() for t in tensors)


def test_float16_overflow_is_skipped_backs_off_and_resumes_bit_identically(tiny_model_dir, tmp_path,
                                                                          overflow_injected, capsys):
    common = ["--recipe", "tiny_cpu", f"model.path={tiny_model_dir}", "model.dtype=float16",
              "quant.compute_dtype=float16", "data.packing=false", "data.micro_batch_size=4", "data.grad_accum_steps=1",
              "data.eval_samples=8", "train.max_steps=6", "train.eval_every=0", "train.save_every=2",
              "train.keep_last=5", "optim.loss_scale_growth_interval=2", "logging.plot=false"]
    straight = tmp_path / "straight"
    assert main([*common, f"train.output_dir={straight}"]) == 0
    assert "float16: the loss is scaled dynamically" in capsys.readouterr().out
    steps = metrics(straight)
    assert [r["skipped"] for r in steps] == [0, 0, 1, 0, 0, 0]
    # 2 good steps double it; the overflow halves it and restarts the count
    assert [r["loss_scale"] for r in steps] == [65536.0, 65536.0, 131072.0, 65536.0, 65536.0, 131072.0]
    assert all(math.isfinite(r["loss"]) for r in steps) and not math.isfinite(steps[2]["grad_norm"])
    summary = json.loads((straight / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["overflow_steps"] == summary["skipped_steps"] == 1
    assert all_finite(overflow_injected[0])
    unscaled = tmp_path / "unscaled"  # the gradients are divided by the scale again: the norm of scale 1's
    assert main([*common, f"train.output_dir={unscaled}", "train.max_steps=1", "optim.loss_scale_init=1"]) == 0
    assert steps[0]["grad_norm"] == pytest.approx(metrics(unscaled)[0]["grad_norm"], rel=1e-2)

    resumed = tmp_path / "resumed"  # from step 4, after the overflow: the scale and its count must come back
    assert main([*common, f"train.output_dir={resumed}",
                 f"train.resume={straight / 'checkpoints' / 'step-000004'}"]) == 0
    assert [r["loss_scale"] for r in metrics(resumed)] == [65536.0, 131072.0]
    assert [r["loss"] for r in metrics(resumed)] == [r["loss"] for r in steps[4:]]
    adapter = "adapter/adapter_model.safetensors"
    assert (resumed / adapter).read_bytes() == (straight / adapter).read_bytes()
