"""LoRA inits that move part of each weight into the adapter and leave the rest in the base: PiSSA (its principal
singular directions; exact SVD or the fast randomized one), OLoRA (its QR factors) and LoFTQ (alternating 4-bit
quantization and SVD of what the quantization lost), as PEFT 0.21 computes them.

Each takes the full-precision weight [out, in] and returns the adapter's A [r, in] and B [out, r] and the base
[out, in] that the 4-bit weight is to hold; the base plus scale * B A is the weight again (LoftQ: its 4-bit
approximation plus the low-rank part of the error). The factors are rounded to the adapter's dtype before the
residual is taken, so the base matches the adapter that trains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qlora_fsdp.config.schema import PISSA_FAST


@dataclass(frozen=True)
class InitialAdapter:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    base: torch.Tensor  # [out, in], fp32: what the 4-bit weight holds


def pissa_factors(weight: torch.Tensor, r: int, scale: float, niter: int | None,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PiSSA: A = sqrt(S_r / scale) U_r^T-side rows, B = the left vectors times the same; exact SVD, or torch's
    randomized one (niter) from a generator seeded per weight, so every rank and every load finds the same."""
    if niter is None:
        left, singular, right_h = torch.linalg.svd(weight, full_matrices=False)
        left, singular, right_h = left[:, :r], singular[:r], right_h[:r]
    else:
        devices = [weight.device] if weight.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            left, singular, right = torch.svd_lowrank(weight, q=r, niter=niter)
        right_h = right.t()
    root = torch.sqrt(singular / scale)
    return torch.diag(root) @ right_h, left @ torch.diag(root)


def olora_factors(weight: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """OLoRA: A = the first r rows of R, B = the first r columns of Q (W = QR)."""
    q, upper = torch.linalg.qr(weight)
    return upper[:r].contiguous(), q[:, :r].contiguous()


def low_rank(matrix: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, R) with L R the best rank-r approximation: U sqrt(S), sqrt(S) V^T (PEFT's _low_rank_decomposition)."""
    left, singular, right_h = torch.linalg.svd(matrix, full_matrices=False)
    root = torch.sqrt(singular[:r])
    return left[:, :r] * root, root[:, None] * right_h[:r]


def loftq(weight: torch.Tensor, r: int, scale: float, iterations: int,
          round_trip: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LoftQ's alternation: quantize what the adapter leaves, take the rank-r part of what quantization lost. PEFT
    leaves L and R unscaled, so its start is the weight only at lora_alpha = r; here both are divided by
    sqrt(scale), so scale * B A is L R at any alpha (the same tensors as PEFT's at alpha = r)."""
    left = right = None
    quantized_input = weight
    for iteration in range(iterations):
        quantized_input = weight if left is None or right is None else weight - left @ right
        left, right = low_rank(weight - round_trip(quantized_input), r)
        if iteration + 1 == iterations:
            break
    assert left is not None and right is not None, "LoftQ runs at least one iteration"
    root = scale ** 0.5
    return right / root, left / root, quantized_input


def initial_adapter(init: str, weight: torch.Tensor, r: int, scale: float, dtype: torch.dtype, seed: int,
                    loftq_iterations: int, round_trip: Callable[[torch.Tensor], torch.Tensor]) -> InitialAdapter:
    """The adapter's start and the base to quantize, for `weight` (any dtype; computed in fp32)."""
    weight = weight.float()
    if init == "loftq":
        a, b, base = loftq(weight, r, scale, loftq_iterations, round_trip)
        return InitialAdapter(a.to(dtype), b.to(dtype), base)
    if init == "olora":
        a, b = olora_factors(weight, r)
    else:
        niter = int(init.removeprefix(PISSA_FAST)) if init.startswith(PISSA_FAST) else None
        a, b = pissa_factors(weight, r, scale, niter, seed)
    a, b = a.to(dtype), b.to(dtype)
    return InitialAdapter(a, b, weight - scale * (b.float() @ a.float()))
