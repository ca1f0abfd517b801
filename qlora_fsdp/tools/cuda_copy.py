"""CUDA's bf16 copy behaviour on the CPU: how the CPU suite and `make gpu-check --dry-run` show what a GPU would
do to FSDP2's all-gather copy-in (the positive control of the uint8 storage of packed 4-bit weights).

Shared by tests/test_numerics.py and tests/gpu_check_cases.py, hence in the package.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

BF16_CANONICAL_NAN = 0x7FFF


@contextmanager
def cuda_bf16_copy_emulated() -> Iterator[None]:
    """`torch._foreach_copy_` as CUDA runs it on sm80+: bf16 is read through float, so every bf16 NaN bit
    pattern is written back as 0x7FFF (on CPU the copy is byte-exact). FSDP2's all-gather copy-in calls it."""
    original = torch._foreach_copy_

    # the parameters named and typed as torch's own signature has them, so the stand-in is a drop-in
    def canonicalizing_copy(self: list[torch.Tensor] | tuple[torch.Tensor, ...],
                            src: list[torch.Tensor] | tuple[torch.Tensor, ...], non_blocking: bool = False) -> None:
        original(self, src, non_blocking=non_blocking)
        for dst in self:
            if dst.dtype == torch.bfloat16:
                dst.view(torch.int16)[dst.isnan()] = BF16_CANONICAL_NAN

    torch._foreach_copy_ = canonicalizing_copy
    try:
        yield
    finally:
        torch._foreach_copy_ = original
