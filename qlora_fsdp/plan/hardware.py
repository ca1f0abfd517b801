"""Known accelerators: memory for the planner, dense half-precision peak for MFU, bf16 or not for `auto` dtypes."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from qlora_fsdp.config import HardwareConfig
from qlora_fsdp.precision import DeviceDescription, cpu_has_bf16


@dataclass(frozen=True)
class GPU:
    memory_gib: float
    bf16_tflops: float  # dense peak (vendor datasheets), for MFU; fp16 for GPUs without bf16
    bf16: bool = True  # compute capability 8.0+; without it `auto` trains in float16 with loss scaling


# L40/L40S: NVIDIA's L40/L40S datasheet (bf16 tensor 181.05 and 362.05 TFLOP/s dense; 48 GB GDDR6 with ECC, on
# by default, which leaves about 45 GiB: nvidia-smi's 46,068 MiB, not yet seen on one here). H100 PCIe: NVIDIA's
# H100 datasheet (1,513 TFLOP/s with sparsity, half that dense; 80 GB). H100 NVL: NVIDIA's H100 page (1,671 with
# sparsity; 94 GB), a figure the datasheets found here did not carry
GPUS = {
    "rtx3090": GPU(24.0, 71.0),
    "rtx4090": GPU(24.0, 165.2),
    "rtx6000ada": GPU(48.0, 364.2),
    "l4": GPU(24.0, 121.0),
    "l40": GPU(45.0, 181.0),
    "l40s": GPU(45.0, 362.0),
    "a100-40gb": GPU(40.0, 312.0),
    "a100-80gb": GPU(80.0, 312.0),
    "h100": GPU(79.6, 989.0),  # SXM
    "h100-pcie": GPU(79.6, 756.0),
    "h100-nvl": GPU(93.6, 835.0),
    "h200": GPU(139.8, 989.0),
    # T4: NVIDIA's T4 datasheet (65 TFLOP/s fp16 tensor; 16 GB GDDR6, nvidia-smi's 15,360 MiB), compute capability
    # 7.5 (Kaggle's and Colab's free GPUs). V100: NVIDIA's V100 datasheet, SXM2 16 GB (125 TFLOP/s fp16), capability 7.0
    "t4": GPU(15.0, 65.0, bf16=False),
    "v100-16gb": GPU(15.8, 125.0, bf16=False),
    "cpu": GPU(math.inf, 0.0),
}
# words of torch.cuda.get_device_name -> table key, most specific first; whole words, since "L4" is inside
# "L40S" and "H100" inside "H100 PCIe"
NAME_HINTS = ((("H100", "NVL"), "h100-nvl"), (("H100", "PCIE"), "h100-pcie"), (("H100",), "h100"),
              (("H200",), "h200"), (("A100", "80GB"), "a100-80gb"), (("A100",), "a100-40gb"),
              (("L40S",), "l40s"), (("L40",), "l40"), (("L4",), "l4"), (("4090",), "rtx4090"),
              (("3090",), "rtx3090"), (("6000", "ADA"), "rtx6000ada"), (("T4",), "t4"),
              (("V100", "16GB"), "v100-16gb"))


def gpu_key(device_name: str) -> str | None:
    """The table's name for a device name as CUDA reports it ("NVIDIA A100-SXM4-80GB" -> a100-80gb), or None."""
    words = set(re.split(r"[\s_-]+", device_name.upper()))
    return next((key for hint, key in NAME_HINTS if words.issuperset(hint)), None)


def detect_gpu(device: torch.device) -> str | None:
    """The table's name for this CUDA device, or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    return gpu_key(torch.cuda.get_device_name(device))


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of this device in FLOP/s, where known."""
    key = detect_gpu(device)
    return GPUS[key].bf16_tflops * 1e12 if key else None


def planned_device(hardware: HardwareConfig) -> DeviceDescription:
    """The recipe's hardware as `auto` dtypes see it; an unknown GPU name is left to the planner's own error."""
    if hardware.gpu == "cpu":
        return DeviceDescription("cpu", cpu_bf16=cpu_has_bf16())
    spec = GPUS.get(hardware.gpu)
    return DeviceDescription("cuda", (8, 0) if spec is None or spec.bf16 else (7, 5))
