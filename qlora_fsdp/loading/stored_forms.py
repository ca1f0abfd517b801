"""Checkpoints whose weights are stored quantized, and what loading makes of them.

- **bitsandbytes 4-bit** (transformers' `save_pretrained` of a 4-bit model; the hub's `*-bnb-4bit` repos): each
  quantized linear's weight is stored packed (two 4-bit values a byte, in uint8 or another storage dtype) beside its
  statistics `<weight>.absmax`, `.quant_map`, `.nested_absmax`, `.nested_quant_map` and `.quant_state.bitsandbytes__
  nf4` (a JSON of the settings, as bytes). They are used as they are: a rank copies its rows of the packed bytes and
  rebuilds the quantization state, nothing is dequantized or quantized again.
- **MXFP4 experts** (gpt-oss as OpenAI ships it): each experts parameter is stored as `<name>_blocks` (two 4-bit
  values a byte, 32 values a block) and `<name>_scales` (a power of two a block). They are dequantized with
  transformers' own decoder, one expert at a time, and then quantized to NF4 like every other expert: training
  computes with NF4 experts either way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import bitsandbytes.functional as bnbf
import torch
from transformers import PretrainedConfig

from qlora_fsdp.config import QuantConfig
from qlora_fsdp.errors import ConfigError, ModelLoadError
from qlora_fsdp.families import quant_method

MXFP4_PARTS = ("blocks", "scales")
BNB_STATISTICS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
BNB_STATE_PREFIX = "quant_state.bitsandbytes__"  # + the quant type: the settings, JSON as uint8 bytes
# what each quantization_config.quant_method stores, for the one line that refuses it
UNTRAINABLE_FORMS = {
    "gptq": "GPTQ", "awq": "AWQ", "fp8": "FP8", "fbgemm_fp8": "FP8", "compressed-tensors": "compressed-tensors",
    "hqq": "HQQ", "quanto": "quanto", "eetq": "EETQ (8-bit)", "aqlm": "AQLM", "vptq": "VPTQ", "higgs": "HIGGS",
    "torchao": "torchao", "bitnet": "BitNet", "spqr": "SpQR", "auto-round": "AutoRound", "quark": "Quark",
}


def mxfp4_part(key: str) -> tuple[str, str] | None:
    """(the parameter's key, "blocks" or "scales") for a stored MXFP4 tensor's key."""
    stem, _, part = key.rpartition("_")
    return (stem, part) if part in MXFP4_PARTS and stem else None


def mxfp4_experts(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Experts [n, in, out] (gpt-oss's layout) from their blocks [n, out, in / 32, 16] and scales [n, out, in / 32]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


def quantization_settings(config: PretrainedConfig) -> dict:
    quantization = getattr(config, "quantization_config", None) or {}
    return quantization if isinstance(quantization, dict) else quantization.to_dict()


def refuse_untrainable_form(config: PretrainedConfig, config_file: Path) -> None:
    """Checkpoints stored in a form training cannot start from are refused before anything is built: one line that
    names the form. bitsandbytes 4-bit and gpt-oss's MXFP4 experts are trained from (checked further at build)."""
    method = quant_method(config)
    if method is None or method == "mxfp4":
        return
    settings = quantization_settings(config)
    if method == "bitsandbytes" and settings.get("load_in_4bit"):
        return
    name = "8-bit bitsandbytes" if method == "bitsandbytes" else UNTRAINABLE_FORMS.get(method, method)
    raise ModelLoadError(f"{config_file} says its weights are stored in {name} (quantization_config.quant_method "
                         f"'{method}'), which training here cannot start from: use the unquantized checkpoint or a "
                         "bitsandbytes 4-bit (NF4) one")


def refuse_contradicting_recipe(config: PretrainedConfig, quant: QuantConfig, config_file: Path) -> None:
    """A pre-quantized checkpoint's 4-bit values are fixed: the recipe must describe them, not other settings."""
    if quant_method(config) != "bitsandbytes":
        return
    settings = quantization_settings(config)
    stored = {"quant.quant_type": settings.get("bnb_4bit_quant_type", "fp4"),
              "quant.double_quant": bool(settings.get("bnb_4bit_use_double_quant", False))}
    wanted = {"quant.quant_type": quant.quant_type, "quant.double_quant": quant.double_quant}
    for key, value in stored.items():
        if wanted[key] != value:
            shown = str(value).lower()
            raise ConfigError(f"{config_file} holds bitsandbytes 4-bit weights quantized with {key}={shown}, which "
                              f"the recipe's {key}={str(wanted[key]).lower()} contradicts: add {key}={shown} (the "
                              "stored 4-bit values are trained from as they are)")


def bnb_4bit_part(key: str) -> tuple[str, str] | None:
    """(the weight's key, which statistic) for a stored statistic of a bitsandbytes 4-bit weight."""
    weight, _, part = key.rpartition(".weight.")
    if weight and (part in BNB_STATISTICS or part.startswith(BNB_STATE_PREFIX)):
        return f"{weight}.weight", part
    return None


def quantized_weight_keys(stored_keys: list[str]) -> set[str]:
    """The weights a checkpoint stores in bitsandbytes 4-bit: those with a quantization state entry."""
    return {found[0] for key in stored_keys
            if (found := bnb_4bit_part(key)) is not None and found[1].startswith(BNB_STATE_PREFIX)}


@dataclass
class StoredQuantState:
    """A bitsandbytes quantization state rebuilt from its stored statistics."""

    state: bnbf.QuantState
    nested: bool

    def check(self, key: str, shape: tuple[int, int], quant: QuantConfig) -> None:
        """The stored state must be of this weight and of the recipe's settings (the model was built with them)."""
        stored = tuple(self.state.shape)
        if stored != shape:
            raise ModelLoadError(f"the 4-bit weight '{key}' was quantized with shape {stored}, where the config "
                                 f"wants {shape}: config and weights disagree")
        if self.state.blocksize != quant.blocksize:
            raise ConfigError(f"the 4-bit weight '{key}' was quantized with blocksize {self.state.blocksize}: add "
                              f"quant.blocksize={self.state.blocksize}")
        if self.state.quant_type != quant.quant_type or self.nested != quant.double_quant:
            raise ModelLoadError(f"the 4-bit weight '{key}' was quantized as {self.state.quant_type}, double "
                                 f"quantization {'on' if self.nested else 'off'}, unlike config.json's "
                                 "quantization_config: a checkpoint of mixed settings is not supported")


def is_packed_shape(shape: tuple[int, ...]) -> bool:
    """Packed 4-bit bytes are stored as one column (a weight to quantize has at least a blocksize of columns)."""
    return len(shape) == 2 and shape[1] == 1


class StoredStatistics:
    """The statistics of each pre-quantized weight, held until all of them have come (a file stores them by dtype,
    far apart); they are small: about one float a block of 64 values. The states dequantize to `dtype` (model.dtype,
    as weights quantized at load do): the stored dtype (the one the weights had, bf16 on the hub) would round them
    in training's matmuls and not in bitsandbytes' fused no-grad ones."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.parts: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, key: str, part: str, tensor: torch.Tensor, device: torch.device) -> StoredQuantState | None:
        """The weight's state once this statistic completes it, else None."""
        parts = self.parts.setdefault(key, {})
        parts[part] = tensor
        settings = next((value for name, value in parts.items() if name.startswith(BNB_STATE_PREFIX)), None)
        if settings is None:
            return None
        nested = "nested_blocksize" in json.loads(bytes(settings.flatten().tolist()).decode())
        needed = {"absmax", "quant_map"} | ({"nested_absmax", "nested_quant_map"} if nested else set())
        if not needed <= parts.keys():
            return None
        del self.parts[key]
        state = bnbf.QuantState.from_dict(parts, device)
        state.dtype = self.dtype
        return StoredQuantState(state, nested)

    def incomplete(self) -> str | None:
        """A weight some of whose statistics never came."""
        return next(iter(self.parts), None)


def packed_byte_rows(stored_rows: torch.Tensor, first_byte: int, n_bytes: int) -> torch.Tensor:
    """Bytes [first_byte, first_byte + n_bytes) of packed 4-bit values stored in any dtype (uint8, or bf16 when
    transformers saved with bnb_4bit_quant_storage=bfloat16), as the [n, 1] uint8 rows our parameters hold.
    `stored_rows` are the stored rows that cover them, starting at stored row first_byte // itemsize."""
    flat = stored_rows.contiguous().view(torch.uint8).flatten()
    offset = first_byte % stored_rows.element_size()
    return flat[offset : offset + n_bytes].reshape(-1, 1)
