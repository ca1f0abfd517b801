"""Checkpoints whose weights are stored quantized, and what loading makes of them.

- **MXFP4 experts** (gpt-oss as OpenAI ships it): each experts parameter is stored as `<name>_blocks` (two 4-bit
  values a byte, 32 values a block) and `<name>_scales` (a power of two a block). They are dequantized with
  transformers' own decoder, one expert at a time, and then quantized to NF4 like every other expert: training
  computes with NF4 experts either way.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

MXFP4_PARTS = ("blocks", "scales")


def quant_method(config: PretrainedConfig) -> str | None:
    quantization = getattr(config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    return getattr(quantization, "quant_method", None) if method is None else method


def mxfp4_part(key: str) -> tuple[str, str] | None:
    """(the parameter's key, "blocks" or "scales") for a stored MXFP4 tensor's key."""
    stem, _, part = key.rpartition("_")
    return (stem, part) if part in MXFP4_PARTS and stem else None


def mxfp4_experts(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Experts [n, in, out] (gpt-oss's layout) from their blocks [n, out, in / 32, 16] and scales [n, out, in / 32]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)
