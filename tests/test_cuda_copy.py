"""The CPU's stand-in for CUDA's copy (tests/cuda_copy.py), which the check of the packed 4-bit storage
(tests/test_numerics.py: test_packed_weights_survive_cuda_copy_behaviour) and the GPU check's dry run rely on.

Held to what `torch._foreach_copy_` did on an H100 (torch 2.11, CUDA 13), written out here: a list of one dtype
takes the fused path, which reads bf16 and float16 through float and writes every NaN as 0x7FFF, whatever its sign
and payload; every other value, and uint8 and float32, come through bit for bit; a list of mixed dtypes is copied
tensor by tensor, bit for bit. On the CPU torch's own copy is bit-exact (the control)."""

from __future__ import annotations

import torch

from tests.cuda_copy import cuda_bf16_copy_emulated

CUDA_NAN = 0x7FFF
NANS = [0x7FC0, 0x7FC1, 0x7F81, 0xFFC0, 0xFFFF, 0x7FFF]  # quiet and signalling, either sign, payloads
NOT_NANS = [0x0000, 0x8000, 0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x7F7F, 0x0001]  # zeros, +-1, +-inf, largest, tiniest
PACKED = [0xC1, 0x7F, 0x12, 0x34]  # 4-bit pairs; the first two bytes read as a bf16 NaN


def bf16_of(patterns: list[int]) -> torch.Tensor:
    return torch.tensor(patterns, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # wraps as two's complement


def patterns_of(tensor: torch.Tensor) -> list[int]:
    return [p & 0xFFFF for p in tensor.view(torch.int16).tolist()]


def copied(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    destinations = [torch.zeros_like(source) for source in sources]
    torch._foreach_copy_(destinations, sources)
    return destinations


def sources() -> dict[str, torch.Tensor]:
    return {"bf16": bf16_of(NANS + NOT_NANS),
            "fp16": torch.tensor([0x7E01, 0x3C00], dtype=torch.int16).view(torch.float16),  # a NaN, 1.0
            "fp32": torch.tensor([0x7FC00001, -0x3FFFFF], dtype=torch.int32).view(torch.float32),  # NaN payloads
            "uint8": torch.tensor(PACKED, dtype=torch.uint8),
            "packed_as_bf16": torch.tensor(PACKED, dtype=torch.uint8).view(torch.bfloat16)}  # the old storage


def test_the_emulated_copy_rewrites_nans_as_cudas_fused_copy_does():
    given = sources()
    assert patterns_of(copied([given["bf16"]])[0]) == NANS + NOT_NANS  # the CPU's own copy: bit-exact
    original = torch._foreach_copy_
    with cuda_bf16_copy_emulated():
        alone = {name: copied([tensor])[0] for name, tensor in given.items()}  # one dtype a list: the fused path
        mixed = dict(zip(given, copied(list(given.values())), strict=True))
    assert torch._foreach_copy_ is original  # put back
    assert patterns_of(alone["bf16"]) == [CUDA_NAN] * len(NANS) + NOT_NANS
    assert patterns_of(alone["fp16"]) == [CUDA_NAN, 0x3C00]
    assert torch.equal(alone["fp32"].view(torch.int32), given["fp32"].view(torch.int32))
    assert alone["uint8"].tolist() == PACKED
    assert alone["packed_as_bf16"].view(torch.uint8).tolist() == [0xFF, 0x7F, 0x12, 0x34]  # a 4-bit pair rewritten
    for name, tensor in mixed.items():  # tensor by tensor
        assert tensor.view(torch.uint8).tolist() == given[name].view(torch.uint8).tolist(), name
