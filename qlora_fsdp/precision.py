"""`model.dtype: auto` and `quant.compute_dtype: auto`: the half precision a device computes fast, or float32.

- bfloat16 on GPUs of compute capability 8.0 and up (RTX 30xx/40xx/50xx, A100, L4/L40, H100);
- float16 on older GPUs (T4, V100, RTX 20xx), which have no bf16 units: training then scales the loss
  (training/loss_scale.py), since float16's range is too narrow for small gradients;
- float32 on a CPU without bf16 units (no AVX512-BF16 or AMX): bf16 there is emulated, a step of a 135M model
  took over 8 minutes instead of seconds (DESIGN.md, fact 14); bfloat16 on a CPU that has them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from qlora_fsdp.config import Config, DType

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bf16 arithmetic


@dataclass(frozen=True)
class DeviceDescription:
    """What `auto` needs to know of a device: its kind, a GPU's compute capability, a CPU's bf16 units."""

    kind: Literal["cuda", "cpu"]
    capability: tuple[int, int] | None = None
    cpu_bf16: bool = False

    def auto_dtype(self) -> DType:
        if self.kind == "cuda":
            return "bfloat16" if self.capability is not None and self.capability >= (8, 0) else "float16"
        return "bfloat16" if self.cpu_bf16 else "float32"

    def reason(self) -> str:
        if self.kind == "cuda":
            major, minor = self.capability or (0, 0)
            fast = "has" if (major, minor) >= (8, 0) else "has no"
            return f"a GPU of compute capability {major}.{minor} {fast} bf16 units"
        return f"this CPU {'has' if self.cpu_bf16 else 'has no'} bf16 units (AVX512-BF16 or AMX)"


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU's flags include bf16 arithmetic; False where /proc/cpuinfo cannot be read."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.is_file() else ""
    flags = {word for line in cpuinfo.splitlines() if line.startswith("flags") for word in line.split()}
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def describe_device(device: torch.device) -> DeviceDescription:
    if device.type == "cuda":
        return DeviceDescription("cuda", tuple(torch.cuda.get_device_capability(device)))  # type: ignore[arg-type]
    return DeviceDescription("cpu", cpu_bf16=cpu_has_bf16())


def resolve_dtypes(cfg: Config, device: DeviceDescription) -> Config:
    """The config with `auto` replaced by the device's dtype (model.dtype and quant.compute_dtype)."""
    chosen = device.auto_dtype()
    model = dataclasses.replace(cfg.model, dtype=chosen if cfg.model.dtype == "auto" else cfg.model.dtype)
    quant = dataclasses.replace(
        cfg.quant, compute_dtype=chosen if cfg.quant.compute_dtype == "auto" else cfg.quant.compute_dtype)
    return dataclasses.replace(cfg, model=model, quant=quant)


def describe_dtypes(recipe: Config, resolved: Config, device: DeviceDescription) -> str:
    """The start-up line: which dtypes the run computes in, and why where `auto` chose them."""
    line = f"dtypes: weights {resolved.model.dtype}, 4-bit compute {resolved.quant.compute_dtype}"
    if "auto" in (recipe.model.dtype, recipe.quant.compute_dtype):
        line += f" (auto: {device.reason()})"
    if uses_loss_scaling(resolved):
        line += "; float16: the loss is scaled dynamically, steps whose gradients overflow are skipped"
    return line


def uses_loss_scaling(cfg: Config) -> bool:
    """float16 activations need loss scaling, or small gradients flush to zero and large ones overflow."""
    return "float16" in (cfg.model.dtype, cfg.quant.compute_dtype)
