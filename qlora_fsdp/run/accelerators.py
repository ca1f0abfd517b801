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
    bf16_tflops: float  # dense peak with fp32 accumulation (vendor datasheets), for MFU; fp16 without bf16
    bf16: bool = True  # compute capability 8.0+; without it `auto` trains in float16 with loss scaling
    memory_gbps: float = 0.0  # device memory bandwidth, GB/s (datasheet)
    pcie_gen: int = 4
    pcie_lanes: int = 16
    nvlink_gbps: float = 0.0  # GPU-to-GPU link, GB/s each way (SXM boards); 0: collectives cross PCIe
    peer_to_peer: bool = True  # PCIe peer-to-peer; GeForce cards have it off: NCCL goes through host memory

    @property
    def priced(self) -> bool:
        """The table has what the step-time model prices a step with (not the CPU)."""
        return bool(self.bf16_tflops and self.memory_gbps)

    @property
    def pcie_gbps(self) -> float:
        """The link's signalling rate each way, after line coding (8b/10b to gen 2, 128b/130b from gen 3)."""
        per_lane = {3: 8.0, 4: 16.0, 5: 32.0}[self.pcie_gen] * 128 / 130 / 8
        return per_lane * self.pcie_lanes


# Datasheets (NVIDIA's, per product). bf16 tensor throughput is the dense figure with fp32 accumulation (GeForce
# cards: half their fp16-accumulate figure; the sparse figures are twice the dense). L40/L40S: 181.05 and 362.05
# TFLOP/s dense, 48 GB GDDR6 with ECC on by default, about 45 GiB usable. H100 PCIe: 1,513 with sparsity; H100 NVL:
# 1,671 with sparsity, 94 GB. NVLink each way: A100 SXM 12 links x 25 GB/s, H100/H200 SXM 18 x 25, V100 SXM2 6 x 25.
# RTX 5090: 32 GB GDDR7 (nvidia-smi 32,607 MiB) at 1,792 GB/s, PCIe 5.0; 209.5 bf16 dense with fp32 accumulation
# (the RTX Blackwell whitepaper's GeForce figure). RTX 4080: 16 GB GDDR6X at 716.8 GB/s, 194.9 fp16-accumulate
# dense. A5000/A6000: 222.2 and 309.7 tensor TFLOP/s with sparsity.
GPUS = {
    "rtx3090": GPU(24.0, 71.0, memory_gbps=936, peer_to_peer=False),
    "rtx4080": GPU(16.0, 97.5, memory_gbps=717, peer_to_peer=False),
    "rtx4090": GPU(24.0, 165.2, memory_gbps=1008, peer_to_peer=False),
    "rtx5090": GPU(31.8, 209.5, memory_gbps=1792, pcie_gen=5, peer_to_peer=False),
    "rtxa5000": GPU(24.0, 111.1, memory_gbps=768),
    "rtxa6000": GPU(48.0, 154.8, memory_gbps=768),
    "rtx6000ada": GPU(48.0, 364.2, memory_gbps=960),
    "l4": GPU(24.0, 121.0, memory_gbps=300),
    "l40": GPU(45.0, 181.0, memory_gbps=864),
    "l40s": GPU(45.0, 362.0, memory_gbps=864),
    "a100-40gb": GPU(40.0, 312.0, memory_gbps=1555, nvlink_gbps=300),  # SXM
    "a100-80gb": GPU(80.0, 312.0, memory_gbps=2039, nvlink_gbps=300),  # SXM
    "a100-40gb-pcie": GPU(40.0, 312.0, memory_gbps=1555),
    "a100-80gb-pcie": GPU(80.0, 312.0, memory_gbps=1935),
    "h100": GPU(79.6, 989.0, memory_gbps=3350, pcie_gen=5, nvlink_gbps=450),  # SXM
    "h100-pcie": GPU(79.6, 756.0, memory_gbps=2000, pcie_gen=5),
    "h100-nvl": GPU(93.6, 835.0, memory_gbps=3900, pcie_gen=5),
    "h200": GPU(139.8, 989.0, memory_gbps=4800, pcie_gen=5, nvlink_gbps=450),
    # T4: NVIDIA's T4 datasheet (65 TFLOP/s fp16 tensor; 16 GB GDDR6 at 320 GB/s, nvidia-smi's 15,360 MiB), compute
    # capability 7.5 (Kaggle's and Colab's free GPUs). V100: NVIDIA's V100 datasheet, SXM2 16 GB (125 TFLOP/s fp16),
    # capability 7.0
    "t4": GPU(15.0, 65.0, bf16=False, memory_gbps=320, pcie_gen=3),
    "v100-16gb": GPU(15.8, 125.0, bf16=False, memory_gbps=900, pcie_gen=3, nvlink_gbps=150),
    "cpu": GPU(math.inf, 0.0),
}
# the cards GRPO's fused decoding kernels are built for (generation.kernels): sm86 (RTX 3090, A5000, A6000),
# sm89 (RTX 4080/4090, 6000 Ada, L4, L40, L40S), sm90 (H100, H200)
FUSED_KERNEL_GPUS = frozenset({"rtx3090", "rtxa5000", "rtxa6000", "rtx4080", "rtx4090", "rtx6000ada", "l4", "l40",
                               "l40s", "h100", "h100-pcie", "h100-nvl", "h200"})
# words of torch.cuda.get_device_name -> table key, most specific first; whole words, since "L4" is inside
# "L40S" and "H100" inside "H100 PCIe"
NAME_HINTS = ((("H100", "NVL"), "h100-nvl"), (("H100", "PCIE"), "h100-pcie"), (("H100",), "h100"),
              (("H200",), "h200"), (("A100", "80GB", "PCIE"), "a100-80gb-pcie"), (("A100", "80GB"), "a100-80gb"),
              (("A100", "PCIE"), "a100-40gb-pcie"), (("A100",), "a100-40gb"),
              (("L40S",), "l40s"), (("L40",), "l40"), (("L4",), "l4"), (("4090",), "rtx4090"),
              (("3090",), "rtx3090"), (("5090",), "rtx5090"), (("6000", "ADA"), "rtx6000ada"),
              (("A5000",), "rtxa5000"), (("A6000",), "rtxa6000"), (("T4",), "t4"),
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
