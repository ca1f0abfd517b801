"""Known accelerators: memory for the planner, dense bf16 peak for MFU."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPU:
    memory_gib: float
    bf16_tflops: float  # dense peak (vendor datasheets), for MFU


GPUS = {
    "rtx3090": GPU(24.0, 71.0),
    "rtx4090": GPU(24.0, 165.2),
    "rtx6000ada": GPU(48.0, 364.2),
    "l4": GPU(24.0, 121.0),
    "a100-40gb": GPU(40.0, 312.0),
    "a100-80gb": GPU(80.0, 312.0),
    "h100": GPU(79.6, 989.0),
    "h200": GPU(139.8, 989.0),
    "cpu": GPU(math.inf, 0.0),
}
NAME_HINTS = (("4090", "rtx4090"), ("3090", "rtx3090"), ("6000 Ada", "rtx6000ada"), ("H200", "h200"),
              ("H100", "h100"), ("A100-SXM4-80GB", "a100-80gb"), ("A100 80GB", "a100-80gb"), ("A100", "a100-40gb"),
              ("L4", "l4"))


def detect_gpu(device: torch.device) -> str | None:
    """The table's name for this CUDA device, or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((key for hint, key in NAME_HINTS if hint in name), None)


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of this device in FLOP/s, where known."""
    key = detect_gpu(device)
    return GPUS[key].bf16_tflops * 1e12 if key else None
