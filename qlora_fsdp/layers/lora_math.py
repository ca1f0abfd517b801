"""LoRA's arithmetic, defined once for training, loading and merge: the update's scale, DoRA's magnitude, and PEFT's
layout of LoRA on a fused experts parameter."""

from __future__ import annotations

import math

import torch


def lora_scale(r: int, alpha: float, use_rslora: bool) -> float:
    """alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's `scaling`)."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def dora_magnitude(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """DoRA's initial magnitude: each output row's norm of the (dequantized) base weight, computed in fp32."""
    return weight.float().norm(dim=1).to(dtype)


def expert_factors(a: torch.Tensor, b: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's LoRA on a fused experts parameter (`a` [r * experts, in], `b` [out, r * experts]) as one factor pair
    an expert: a [experts, r, in] and b [experts, r, out] (x's update is (x a_e^T) b_e)."""
    r = a.shape[0] // n_experts
    return a.unflatten(0, (n_experts, r)), b.unflatten(1, (r, n_experts)).permute(2, 1, 0)


def expert_delta(a: torch.Tensor, b: torch.Tensor, n_experts: int, expert: int, scale: float,
                 transposed: bool) -> torch.Tensor:
    """One expert's update s B_e A_e in fp32, oriented as the experts are stored ([out, in]; gpt-oss [in, out])."""
    a_e, b_e = (factors[expert].float() for factors in expert_factors(a, b, n_experts))
    delta = scale * (b_e.t() @ a_e)  # [out, in]
    return delta.t() if transposed else delta
