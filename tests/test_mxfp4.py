"""gpt-oss's MXFP4 experts as loading decodes them (`stored_forms.mxfp4_experts`), against the format written out
here from its published definition, not through transformers (whose decoder ours calls, so comparing the two
would check nothing).

OCP Microscaling Formats (MX) v1.0: a block of 32 elements shares one E8M0 scale, 2^(bits - 127) (255 is NaN);
each element is FP4 E2M1, bits S EE M, exponent bias 1, exponent 0 subnormal, no infinity or NaN. The spec does
not fix how two elements share a byte: OpenAI's own loader (gpt_oss/torch/weights.py in openai/gpt-oss) puts the
block's even elements in the low nibbles and the odd ones in the high nibbles."""

from __future__ import annotations

import itertools

import pytest
import torch

from qlora_fsdp.loading.stored_forms import mxfp4_experts

BLOCK = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the spec's table of FP4 E2M1 values, codes 0-7


def e2m1(code: int) -> float:
    """An FP4 E2M1 element from its four bits, as the spec defines the encoding."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    if exponent == 0:  # subnormal: 2^(1 - bias) x 0.M
        return sign * mantissa * 0.5
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def e8m0(bits: int) -> float:
    assert bits != 255, "E8M0's NaN"
    return 2.0 ** (bits - 127)


def spec_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Experts [n, in, out] (float64, one element at a time) from blocks [n, out, in / 32, 16] and scales
    [n, out, in / 32]: gpt-oss stores each expert's rows of W^T (x @ W's W is [in, out])."""
    n, out_features, n_blocks, _ = blocks.shape
    weight = torch.empty(n, n_blocks * BLOCK, out_features, dtype=torch.float64)
    for expert, row, block in itertools.product(range(n), range(out_features), range(n_blocks)):
        scale = e8m0(int(scales[expert, row, block]))
        for element in range(BLOCK):
            byte = int(blocks[expert, row, block, element // 2])
            code = byte & 0x0F if element % 2 == 0 else byte >> 4
            weight[expert, block * BLOCK + element, row] = e2m1(code) * scale
    return weight


def test_the_e2m1_bits_give_the_specs_table_of_values():
    assert tuple(e2m1(code) for code in range(8)) == E2M1_MAGNITUDES
    assert tuple(e2m1(code | 0b1000) for code in range(8)) == tuple(-v for v in E2M1_MAGNITUDES)


def test_a_byte_holds_its_blocks_even_element_in_the_low_nibble():
    """One expert, one output, one block: byte 0 = 0x2F (low nibble 0xF = -6, high 0x2 = 1), scale 2^(128 - 127)."""
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x2F
    weight = mxfp4_experts(blocks, torch.full((1, 1, 1), 128, dtype=torch.uint8), torch.float32)
    assert weight.shape == (1, BLOCK, 1)
    assert weight[0, :, 0].tolist() == [-12.0, 2.0] + [0.0] * (BLOCK - 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_decode_as_the_format_defines_them(dtype):
    """Every element exact: E2M1 values times powers of two need 2 significant bits, which bf16 holds too."""
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), dtype=torch.uint8, generator=generator)  # 2 experts, in 64, out 3
    scales = torch.randint(100, 150, (2, 3, 2), dtype=torch.uint8, generator=generator)
    assert {int(b) & 0x0F for b in blocks.flatten()} == set(range(16)) == {int(b) >> 4 for b in blocks.flatten()}
    ours = mxfp4_experts(blocks, scales, dtype)
    assert ours.dtype == dtype and ours.shape == (2, 64, 3)
    expected = spec_decode(blocks, scales)
    assert expected.abs().max() > 0
    assert torch.equal(ours.double(), expected)
