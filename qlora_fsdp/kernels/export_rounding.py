"""`export.target`'s rounding in one Triton kernel: the merged weight as llama.cpp stores it, in one pass.

gguf_target/quantizers.py rounds in plain torch: a dozen element-wise kernels a chunk, each reading and writing
float32 copies, in every forward and checkpointed recompute of every linear (the planner: 67 of 88 seconds of an 8B
step). Here one program reads a group of llama.cpp blocks (the dequantized base, the adapter's product B A and the
k-quants' stored steps), forms the merge (base + s B A, written float16 and read back), rounds it as the type's
quantizer does and writes the weight in the compute dtype: about 8 bytes an element instead of some 150.

It must equal quantizers.py bit for bit, so it computes in its order: each division exact (`div_rn`, where CUDA's
`/` is an approximation), no fused multiply-add (`enable_fp_fusion=False`: a product and the sum after it round
separately, as torch's separate kernels do), rounding to nearest even by adding and subtracting 1.5 * 2^23 (as
llama.cpp's nearest_int), truncation by a cast to int32. The block search of the k-quants stays in torch (once an
optimizer step, its result reused: through_export.py's cache). tests/test_export_target.py runs this kernel under
TRITON_INTERPRET=1 against quantizers.py; the GPU check's export_rounding case runs it on a device.
"""

from __future__ import annotations

import torch

from qlora_fsdp.kernels.nf4_matmul import interpreting, tl, triton

# the kernel's quantizer families, and each type's (family, block size, half range or nmax)
Q8_0, SYMMETRIC, Q5_1, WITH_MIN, Q6_K = range(5)
KINDS = {"q8_0": (Q8_0, 32, 0), "q4_0": (SYMMETRIC, 32, 8), "q5_0": (SYMMETRIC, 32, 16), "q5_1": (Q5_1, 32, 0),
         "q4_K": (WITH_MIN, 32, 15), "q5_K": (WITH_MIN, 32, 31), "q6_K": (Q6_K, 16, 0)}
QK_K = 256
ROUNDING_MAGIC = 12582912.0  # 1.5 * 2^23: x + it - it is x rounded to the nearest integer, ties to even
BLOCKS_A_PROGRAM = 64  # 2,048 elements a program on a GPU
INTERPRETED_BLOCKS_A_PROGRAM = 2048  # the interpreter pays per program: few large ones (numpy's arrays)


def available(device: torch.device) -> bool:
    """Whether the kernel runs for tensors on `device`: a CUDA device with Triton, or the interpreter (tests)."""
    return triton is not None and (device.type == "cuda" or interpreting())


if triton is not None:

    @triton.jit
    def nearest(x):
        return (x + ROUNDING_MAGIC) - ROUNDING_MAGIC

    @triton.jit
    def truncated(x):
        return x.to(tl.int32).to(tl.float32)

    @triton.jit
    def as_half(x):
        return x.to(tl.float16).to(tl.float32)

    @triton.jit
    def inverse_of(d):
        return tl.where(d != 0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d != 0, d, 1.0)), 0.0)

    @triton.jit
    def signed_absmax(m, elements, BS: tl.constexpr):
        """Each block's value of largest magnitude, the first where several tie."""
        peak = tl.max(tl.abs(m), axis=1)
        first = tl.min(tl.where(tl.abs(m) == peak[:, None], elements[None, :], BS), axis=1)
        return tl.sum(tl.where(elements[None, :] == first[:, None], m, 0.0), axis=1)

    @triton.jit
    def stored_steps(d_ptr, multiples_ptr, blocks, mask, PER_SUPER: tl.constexpr):
        """A block's step from its super-block's float16 d and its own int8 multiple."""
        d = tl.load(d_ptr + blocks // PER_SUPER, mask=mask, other=0.0).to(tl.float32)
        return d * tl.load(multiples_ptr + blocks, mask=mask, other=0).to(tl.float32)

    @triton.jit
    def export_rounding_kernel(out_ptr, base_ptr, product_ptr, scale, d_ptr, scales_ptr, dmin_ptr, mins_ptr,
                               n_blocks, KIND: tl.constexpr, HAS_PRODUCT: tl.constexpr, BS: tl.constexpr,
                               NUMBER: tl.constexpr, BP: tl.constexpr, BF16_BITS: tl.constexpr):
        blocks = tl.program_id(0) * BP + tl.arange(0, BP)
        elements = tl.arange(0, BS)
        offsets = blocks[:, None] * BS + elements[None, :]
        mask = blocks[:, None] < n_blocks
        m = tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_PRODUCT:
            m = m + scale * tl.load(product_ptr + offsets, mask=mask, other=0.0)
        m = as_half(m)
        if KIND == 0:  # q8_0: d = absmax / 127, q = roundf(x / d)
            d = tl.math.div_rn(tl.max(tl.abs(m), axis=1), tl.full((BP,), 127.0, tl.float32))
            v = m * inverse_of(d)[:, None]
            whole = truncated(v)
            sign = tl.where(v > 0, 1.0, tl.where(v < 0, -1.0, 0.0))
            value = (whole + sign * (tl.abs(v - whole) >= 0.5).to(tl.float32)) * as_half(d)[:, None]
        elif KIND == 1:  # q4_0 / q5_0: d = signed absmax / -NUMBER, q = trunc(x / d + NUMBER + .5)
            d = tl.math.div_rn(signed_absmax(m, elements, BS), tl.full((BP,), -NUMBER, tl.float32))
            q = tl.minimum(truncated(m * inverse_of(d)[:, None] + (NUMBER + 0.5)), 2 * NUMBER - 1)
            value = (q - NUMBER) * as_half(d)[:, None]
        elif KIND == 2:  # q5_1: from min to max in 31 steps
            low, high = tl.min(m, axis=1), tl.max(m, axis=1)
            d = tl.math.div_rn(high - low, tl.full((BP,), 31.0, tl.float32))
            q = truncated((m - low[:, None]) * inverse_of(d)[:, None] + 0.5)
            value = q * as_half(d)[:, None] + as_half(low)[:, None]
        elif KIND == 3:  # q4_K / q5_K from the stored steps: q = nearest((x + offset) / step) in [0, NUMBER]
            step = stored_steps(d_ptr, scales_ptr, blocks, blocks < n_blocks, 256 // BS)[:, None]
            offset = stored_steps(dmin_ptr, mins_ptr, blocks, blocks < n_blocks, 256 // BS)[:, None]
            ratio = tl.math.div_rn(m + offset, tl.where(step != 0, step, 1.0))
            q = nearest(tl.minimum(tl.maximum(ratio, 0.0), NUMBER))
            value = step * q - offset
        else:  # q6_K from the stored steps: q = nearest(x / step) in [-32, 31]
            step = stored_steps(d_ptr, scales_ptr, blocks, blocks < n_blocks, 256 // BS)[:, None]
            q = nearest(tl.minimum(tl.maximum(tl.math.div_rn(m, tl.where(step != 0, step, 1.0)), -32.0), 31.0))
            value = step * q
        if BF16_BITS:  # bfloat16 by its bits, to nearest even as torch converts (whatever Triton's mode)
            bits = value.to(tl.uint32, bitcast=True)
            tl.store(out_ptr + offsets, ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16), mask=mask)
        else:
            tl.store(out_ptr + offsets, value.to(out_ptr.dtype.element_ty), mask=mask)


@torch.library.custom_op("qlora_fsdp::export_rounded", mutates_args=("out",))
def export_rounded(out: torch.Tensor, base: torch.Tensor, product: torch.Tensor | None, scale: float,
                   ggml_type: str, steps: list[torch.Tensor]) -> None:
    """Write into `out` ([rows, n], contiguous) the merge base + scale * product (product: B A of those rows, or
    None) rounded as llama.cpp stores `ggml_type`, with a k-quant's stored steps of those rows (quantizers.stored)."""
    kind, block, number = KINDS[ggml_type]
    n_blocks = base.numel() // block
    pointers = [*steps, *([base] * (4 - len(steps)))]  # the types without steps never read them
    per_program = INTERPRETED_BLOCKS_A_PROGRAM if interpreting() else BLOCKS_A_PROGRAM
    grid = (triton.cdiv(n_blocks, per_program),)
    bf16, has_product = out.dtype == torch.bfloat16, product is not None
    product = base if product is None else product.contiguous()
    export_rounding_kernel[grid](
        out.view(torch.int16) if bf16 else out, base.contiguous(), product, scale, *pointers, n_blocks,
        KIND=kind, HAS_PRODUCT=has_product, BS=block, NUMBER=number, BP=per_program, BF16_BITS=bf16,
        enable_fp_fusion=False)


@export_rounded.register_fake
def _(out: torch.Tensor, base: torch.Tensor, product: torch.Tensor | None, scale: float, ggml_type: str,
      steps: list[torch.Tensor]) -> None:
    # the planner's fake step: the op's bytes (inputs read, `out` written) are what it prices
    return None
