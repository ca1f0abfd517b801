"""lora.init's inits that move part of each weight into the adapter (PiSSA, OLoRA, LoftQ), wired into loading,
saving and loading back.

While the loader streams a targeted linear's full-precision weight (every rank reads it whole to quantize it), the
init is computed from it, the adapter's A and B are filled, and the base that is quantized is the residual: the 4-bit
weight that trains is the residual's, never the original's. The start (A0, B0) stays on the host for the save,
which writes PEFT's conversion to a plain LoRA of twice the rank that applies to the original base: A' = [A; A0],
B' = [B, -B0], r and alpha doubled (alpha by sqrt 2 under rsLoRA), so PEFT, merge, generate and GGUF export read it
against the original checkpoint. Loading it back for generation takes the trained halves onto the residual base.
"""

from __future__ import annotations

import zlib
from typing import Any, cast

import peft
import torch
from torch import nn

from qlora_fsdp.config import Config, QuantConfig
from qlora_fsdp.config.schema import changes_base
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.layers.lora_inits import initial_adapter
from qlora_fsdp.loading.names import clean_name
from qlora_fsdp.loading.nf4 import as_trained
from qlora_fsdp.loading.placement import copy_full_into

ADAPTER = "default"
STARTS = "initial_adapter"  # the model attribute holding each layer's (A0, B0), on the host


def lora_layer_of(modules: dict[str, nn.Module], linear_name: str) -> nn.Module | None:
    """The PEFT LoRA layer wrapping the 4-bit linear `linear_name` (its base_layer), if it has one."""
    owner = modules.get(linear_name.removesuffix(".base_layer"))
    return owner if owner is not None and ADAPTER in getattr(owner, "lora_A", {}) else None


def round_trip(quant: QuantConfig, dtype: torch.dtype) -> Any:
    """The weight in the model's dtype as the 4-bit model computes with it (nf4.as_trained), in fp32: LoftQ's
    alternation quantizes exactly as the loader then does."""
    return lambda weight: as_trained(weight.to(dtype).contiguous(), quant).float()


def start_of(layer: nn.Module, key: str, weight: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Fill `layer`'s A and B from the full-precision `weight` as lora.init says; the base to quantize (fp32)."""
    lora = cast(Any, layer)
    a_param, b_param = lora.lora_A[ADAPTER].weight, lora.lora_B[ADAPTER].weight
    seed = cfg.train.seed * 1_000_003 + zlib.crc32(key.encode())
    start = initial_adapter(cfg.lora.init, weight, cfg.lora.r, lora.scaling[ADAPTER], TORCH_DTYPES[cfg.lora.dtype],
                            seed, cfg.lora.loftq_iter, round_trip(cfg.quant, TORCH_DTYPES[cfg.model.dtype]))
    copy_full_into(a_param, start.a.to(device=a_param.device, dtype=a_param.dtype))
    copy_full_into(b_param, start.b.to(device=b_param.device, dtype=b_param.dtype))
    starts = cast(dict, vars(layer).setdefault("_start", {}))
    starts[ADAPTER] = (start.a.cpu(), start.b.cpu())
    return start.base


def initialized_layers(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each initialized LoRA layer's (A0, B0), by its clean module name."""
    return {clean_name(name): vars(module)["_start"][ADAPTER] for name, module in model.named_modules()
            if "_start" in vars(module)}


def converted_for_saving(adapter_state: dict[str, torch.Tensor], model: nn.Module, key_of: Any,
                         config: peft.LoraConfig) -> None:
    """PEFT's conversion of a PiSSA/OLoRA/LoftQ adapter to a plain LoRA of twice the rank, in place: the trained A
    and B stacked with the start's (B's negated), r and alpha doubled."""
    for name, (a0, b0) in initialized_layers(model).items():
        a_key, b_key = key_of(f"{name}.lora_A.{ADAPTER}.weight"), key_of(f"{name}.lora_B.{ADAPTER}.weight")
        adapter_state[a_key] = torch.cat([adapter_state[a_key], a0.to(adapter_state[a_key].dtype)], dim=0)
        adapter_state[b_key] = torch.cat([adapter_state[b_key], -b0.to(adapter_state[b_key].dtype)], dim=1)
    setattr(config, "lora_alpha", config.lora_alpha * alpha_factor(config.use_rslora))  # noqa: B010 (PEFT types int)
    config.r *= 2


def alpha_factor(use_rslora: bool) -> float:
    """How the conversion to rank 2r scales alpha so the update's scale stays: alpha/r, or alpha/sqrt(r)."""
    return 2 ** 0.5 if use_rslora else 2


def trained_half(saved: torch.Tensor, param: torch.Tensor, key: str) -> torch.Tensor:
    """The trained half of a converted adapter's A (its first r rows) or B (its first r columns)."""
    if ".lora_A" in key and saved.shape[0] == 2 * param.shape[0]:
        return saved[: param.shape[0]]
    if ".lora_B" in key and saved.shape[1] == 2 * param.shape[1]:
        return saved[:, : param.shape[1]]
    return saved


def initialized(cfg: Config) -> bool:
    return changes_base(cfg.lora.init)
