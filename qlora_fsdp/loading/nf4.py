"""The loader's 4-bit quantization, defined once: what it packs, and the weight the 4-bit model computes with
(quantized, then dequantized), which the merge writes and LoftQ's alternation quantizes against."""

from __future__ import annotations

import bitsandbytes.functional as bnbf
import torch

from qlora_fsdp.config import QuantConfig
from qlora_fsdp.loading.build import QUANT_STORAGE


def quantize(weight: torch.Tensor, quant: QuantConfig, storage: torch.dtype = QUANT_STORAGE
             ) -> tuple[torch.Tensor, bnbf.QuantState]:
    """NF4/FP4 as the config says, packed into `storage` (the dtype the model's 4-bit parameters were built with)."""
    return bnbf.quantize_4bit(
        weight,
        blocksize=quant.blocksize,
        compress_statistics=quant.double_quant,
        quant_type=quant.quant_type,
        quant_storage=storage,
    )


def as_trained(weight: torch.Tensor, quant: QuantConfig) -> torch.Tensor:
    """The weight the 4-bit model computed with: quantized as the loader does, then dequantized."""
    packed, state = quantize(weight, quant)
    return bnbf.dequantize_4bit(packed, state)
