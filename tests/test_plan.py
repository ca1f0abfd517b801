"""The memory planner: exact against what a sharded run really holds; the 70B verdicts from config.json alone."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qlora_fsdp.api import build_model
from qlora_fsdp.trainer import accumulate_gradients
from tests.helpers import REPO, batches, run_ranks, tiny_config, variable_length_samples

PAD = 2


def tensor_bytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def measured_and_planned(info, cfg, micro_batches_per_rank):
    """After one real optimizer step: bytes rank 0 holds, by kind, next to the planner's figures."""
    from load_as_rank import quant_state_bytes as measured_quant_state_bytes  # scripts/, on the path via helpers

    from qlora_fsdp.optim import build_optimizer
    from qlora_fsdp.plan import meta_held, quant_state_bytes
    from qlora_fsdp.sharding import local_shard

    model = build_model(cfg, info)
    optimizer = build_optimizer(model, cfg.optim)
    accumulate_gradients(model, micro_batches_per_rank[info.rank], info.device)
    optimizer.step()  # state exists after the first step
    measured = {"lora": 0, "grads": 0, "base": 0, "optimizer": 0, "quant_state": 0}
    for param in model.parameters():
        if param.requires_grad:
            measured["lora"] += tensor_bytes([local_shard(param)])
            measured["grads"] += tensor_bytes([local_shard(param.grad)])
        else:
            measured["base"] += tensor_bytes([local_shard(param)])
    measured["optimizer"] = sum(tensor_bytes(state.values()) for state in optimizer.inner.state.values())
    measured["quant_state"] = sum(measured_quant_state_bytes(module.quant_state) for module in model.modules()
                                  if getattr(module, "quant_state", None) is not None)
    held = meta_held(cfg, info.mesh)
    planned = {"lora": held.lora, "grads": held.grads, "base": held.base_4bit + held.other_base,
               "optimizer": held.optimizer, "quant_state": held.quant_state}
    assert quant_state_bytes(64 * 64, 64, False) == 64 * 4 + 64  # absmax per block + the 16-value code
    return measured, planned


@pytest.mark.parametrize("optimizer", ["paged_adamw_8bit", "adamw"])
def test_planned_sizes_equal_measured(tiny_model_dir, tmp_path, optimizer):
    # r=64 makes the LoRA shards large enough for bitsandbytes' 8-bit state (4096+ elements); r=16 stays 32-bit
    cfg = tiny_config(tiny_model_dir, optim={"name": optimizer}, lora={"r": 64, "alpha": 128},
                      model={"dtype": "bfloat16"})
    samples = variable_length_samples(cfg, 8)
    per_rank = [batches(samples[:4], 4, PAD), batches(samples[4:], 4, PAD)]
    measured, planned = run_ranks(measured_and_planned, 2, cfg, per_rank, tmp_dir=tmp_path)[0]
    assert measured == planned and all(measured.values())


def test_70b_on_two_4090s_needs_offload():
    # one meta build of the 70B for both presets: offload moves bytes between GPU and host, no shape changes
    code = ("from qlora_fsdp.config import load_config\n"
            "from qlora_fsdp.plan import meta_held, plan, planning_mesh, variants\n"
            "cfg = load_config('llama70b_2x4090', ['fsdp_preset=full_shard'])\n"
            "held = meta_held(cfg, planning_mesh(2))\n"
            "offload = load_config('llama70b_2x4090', ['fsdp_preset=full_shard_cpu_offload'])\n"
            "for name, c in (('full_shard', cfg), ('full_shard_cpu_offload', offload)):\n"
            "    result = plan(c, held)\n"
            "    print(name, 'FITS' if result.fits else 'DOES NOT FIT', round(result.gpu_total / 2**30, 2))\n"
            "print(result.description)\n"
            "print([label for label, c in variants(cfg) if c.lora.r == cfg.lora.r and plan(c, held).fits])\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("full_shard DOES NOT FIT") and float(lines[0].split()[-1]) > 24
    assert lines[1].startswith("full_shard_cpu_offload FITS") and float(lines[1].split()[-1]) < 24
    assert lines[2].startswith("70.55B base parameters")
    assert lines[3].startswith("['fsdp_preset=full_shard_cpu_offload")  # the only single fix, and it is named


def test_mfu_counts_6n_flops_a_token():
    from types import SimpleNamespace

    from qlora_fsdp.trainer import Trainer

    trainer = object.__new__(Trainer)  # only the MFU bookkeeping is exercised
    trainer.info, trainer.flops_per_token, trainer.peak_flops = SimpleNamespace(world_size=2), 0.0, 0.0
    trainer.set_mfu_reference(70_553_706_496, None)  # unknown device (CPU): no MFU reported
    assert trainer.mfu(477.0) == {}
    trainer.set_mfu_reference(70_553_706_496, 165.2e12)
    # Answer.AI's published 70B run: 477 tokens/s on 2x RTX 4090
    assert trainer.mfu(477.0)["mfu"] == pytest.approx(477.0 * 6 * 70_553_706_496 / (2 * 165.2e12))
    assert 0.60 < trainer.mfu(477.0)["mfu"] < 0.62
