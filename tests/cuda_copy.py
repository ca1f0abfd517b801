"""CUDA's bf16 copy behaviour on the CPU: how the CPU suite and `make gpu-check --dry-run` show what a GPU would
do to FSDP2's all-gather copy-in (the positive control of the uint8 storage of packed 4-bit weights).

Shared by tests/test_numerics.py and tests/gpu_check_cases.py, hence in the package.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

CANONICAL_NAN = 0x7FFF  # what CUDA's float -> bf16 and float -> float16 conversions write for any NaN
READ_THROUGH_FLOAT = (torch.bfloat16, torch.float16)


@contextmanager
def cuda_bf16_copy_emulated() -> Iterator[None]:
    """`torch._foreach_copy_` as CUDA runs it on sm80+: a list of one dtype takes the fused path, which reads bf16
    and float16 through float, so every NaN bit pattern of theirs is written back as 0x7FFF; a list of mixed dtypes
    is copied tensor by tensor, byte-exact, as are uint8 and float32 (and everything on CPU). Seen on an H100 (torch
    2.11, CUDA 13): tests/test_cuda_copy.py holds the emulation to it. FSDP2's all-gather copy-in calls it on one
    dtype (mixed dtypes go as uint8 views)."""
    original = torch._foreach_copy_

    # the parameters named and typed as torch's own signature has them, so the stand-in is a drop-in
    def canonicalizing_copy(self: list[torch.Tensor] | tuple[torch.Tensor, ...],
                            src: list[torch.Tensor] | tuple[torch.Tensor, ...], non_blocking: bool = False) -> None:
        original(self, src, non_blocking=non_blocking)
        if len({t.dtype for t in [*self, *src]}) > 1:
            return
        for dst in self:
            if dst.dtype in READ_THROUGH_FLOAT:
                dst.view(torch.int16)[dst.isnan()] = CANONICAL_NAN

    torch._foreach_copy_ = canonicalizing_copy
    try:
        yield
    finally:
        torch._foreach_copy_ = original
