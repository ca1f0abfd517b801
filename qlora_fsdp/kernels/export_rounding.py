"""`export.target`'s rounding in Triton kernels: the merged weight as llama.cpp stores it, in one pass.

gguf_target/quantizers.py rounds in plain torch: a dozen element-wise kernels a chunk, each reading and writing
float32 copies, in every forward and checkpointed recompute of every linear (the planner: 67 of 88 seconds of an 8B
step). Here one program reads a group of llama.cpp blocks (the dequantized base, the adapter's product B A and the
k-quants' stored steps), forms the merge (base + s B A, written float16 and read back), rounds it as the type's
quantizer does and writes the weight in the compute dtype: about 8 bytes an element instead of some 150.

It must equal quantizers.py bit for bit, so it computes in its order: each division exact (`div_rn`, where CUDA's
`/` is an approximation), no fused multiply-add (`enable_fp_fusion=False`: a product and the sum after it round
separately, as torch's separate kernels do), rounding to nearest even by adding and subtracting 1.5 * 2^23 (as
llama.cpp's nearest_int), truncation by a cast to int32. A second kernel makes the k-quants' block search (once an
optimizer step, its result kept: through_export.py's cache), its sums in llama.cpp's order (a block's elements
loaded one column at a time, each sum a chain of additions). tests/test_export_target.py runs both under
TRITON_INTERPRET=1 against quantizers.py; the GPU check's export_rounding case runs them on a device.
"""

from __future__ import annotations

import torch

from qlora_fsdp.kernels.nf4_matmul import interpreting, tl, triton

# the kernel's quantizer families, and each type's (family, block size, half range or nmax)
Q8_0, SYMMETRIC, Q5_1, WITH_MIN, Q6_K = range(5)
KINDS = {"q8_0": (Q8_0, 32, 0), "q4_0": (SYMMETRIC, 32, 8), "q5_0": (SYMMETRIC, 32, 16), "q5_1": (Q5_1, 32, 0),
         "q4_K": (WITH_MIN, 32, 15), "q5_K": (WITH_MIN, 32, 31), "q6_K": (Q6_K, 16, 0)}
# 1.5 * 2^23: x + it - it is x rounded to the nearest integer, ties to even (a kernel reads only constexpr globals)
ROUNDING_MAGIC = tl.constexpr(12582912.0) if tl is not None else 12582912.0
# every launch: a product and the sum after it rounded apart, as torch's kernels do (Triton fuses them by default)
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
BLOCKS_A_PROGRAM = 64  # 2,048 elements a program on a GPU
INTERPRETED_BLOCKS_A_PROGRAM = 2048  # the interpreter pays per program: few large ones (numpy's arrays)


def available(device: torch.device) -> bool:
    """Whether the kernel runs for tensors on `device`: a CUDA device with Triton, or the interpreter (tests)."""
    return triton is not None and (device.type == "cuda" or interpreting())


def search_in_kernel() -> bool:
    """Whether the block search runs in its kernel where the rounding does: not under the interpreter, where one
    call takes seconds (its sums are unrolled loops of small operations); the tests' runs search in torch, to the
    same values (tests/test_export_target.py holds the kernel to it)."""
    return not interpreting()


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


if triton is not None:

    @triton.jit
    def column(x_ptr, blocks, live, j, BS: tl.constexpr):
        """Element j of each block (a vector over the program's blocks): sums walk a block's elements in order."""
        return tl.load(x_ptr + blocks * BS + j, mask=live, other=0.0)

    @triton.jit
    def grid_level(x, inverse, start, NMAX: tl.constexpr):
        return nearest(tl.minimum(tl.maximum(inverse * (x - start), 0.0), NMAX))

    @triton.jit
    def weighted_error(x_ptr, blocks, live, av, scale, start, inverse, grid_start, NMAX: tl.constexpr):
        """sum of w (scale l + start - x)^2 over a block of 32, in order; l on the grid (inverse, grid_start)."""
        x = column(x_ptr, blocks, live, 0, 32)
        diff = scale * grid_level(x, inverse, grid_start, NMAX) + start - x
        total = (av + tl.abs(x)) * (diff * diff)
        for j in range(1, 32):
            x = column(x_ptr, blocks, live, j, 32)
            diff = scale * grid_level(x, inverse, grid_start, NMAX) + start - x
            total = total + (av + tl.abs(x)) * (diff * diff)
        return total

    @triton.jit
    def with_min_search_kernel(x_ptr, candidates_ptr, d_ptr, ls_ptr, dmin_ptr, lm_ptr, n_blocks,
                               NMAX: tl.constexpr, NSTEP: tl.constexpr, BP: tl.constexpr):
        """quantizers.steps_with_min (make_qkx2_quants, then the super-block's 6-bit scales) for BP blocks of 32."""
        blocks = tl.program_id(0) * BP + tl.arange(0, BP)
        live = blocks < n_blocks
        x = column(x_ptr, blocks, live, 0, 32)
        squares, low, high = x * x, x, x
        for j in range(1, 32):
            x = column(x_ptr, blocks, live, j, 32)
            squares, low, high = squares + x * x, tl.minimum(low, x), tl.maximum(high, x)
        av = tl.sqrt_rn(tl.math.div_rn(squares, tl.full((BP,), 32.0, tl.float32)))
        x = column(x_ptr, blocks, live, 0, 32)
        sum_w, sum_x = av + tl.abs(x), (av + tl.abs(x)) * x
        for j in range(1, 32):
            x = column(x_ptr, blocks, live, j, 32)
            sum_w, sum_x = sum_w + (av + tl.abs(x)), sum_x + (av + tl.abs(x)) * x
        offset = tl.minimum(low, 0.0)
        flat = high == offset
        inverse = tl.math.div_rn(tl.full((BP,), NMAX, tl.float32), tl.where(flat, 1.0, high - offset))
        scale = tl.math.div_rn(tl.full((BP,), 1.0, tl.float32), inverse)
        best = weighted_error(x_ptr, blocks, live, av, scale, offset, inverse, offset, NMAX)
        for step in range(NSTEP + 1):
            iscale = tl.math.div_rn(tl.load(candidates_ptr + step) + tl.zeros((BP,), tl.float32),
                                    tl.where(flat, 1.0, high - offset))
            x = column(x_ptr, blocks, live, 0, 32)
            level = grid_level(x, iscale, offset, NMAX)
            weighted = (av + tl.abs(x)) * level
            sum_l, sum_l2, sum_xl = weighted, weighted * level, weighted * x
            for j in range(1, 32):
                x = column(x_ptr, blocks, live, j, 32)
                level = grid_level(x, iscale, offset, NMAX)
                weighted = (av + tl.abs(x)) * level
                sum_l, sum_l2, sum_xl = sum_l + weighted, sum_l2 + weighted * level, sum_xl + weighted * x
            det = sum_w * sum_l2 - sum_l * sum_l
            usable = det > 0
            det = tl.where(usable, det, 1.0)
            this_scale = tl.math.div_rn(sum_w * sum_xl - sum_x * sum_l, det)
            this_offset = tl.math.div_rn(sum_l2 * sum_x - sum_l * sum_xl, det)
            clipped = this_offset > 0
            this_scale = tl.where(clipped, tl.math.div_rn(sum_xl, tl.where(clipped, sum_l2, 1.0)), this_scale)
            this_offset = tl.where(clipped, 0.0, this_offset)
            error = weighted_error(x_ptr, blocks, live, av, this_scale, this_offset, iscale, offset, NMAX)
            better = usable & (error < best) & (flat == 0)
            best = tl.where(better, error, best)
            scale = tl.where(better, this_scale, scale)
            offset = tl.where(better, this_offset, offset)
        store_super_blocks(d_ptr, ls_ptr, tl.where(flat, 0.0, scale), blocks, live, n_blocks, BP)
        store_super_blocks(dmin_ptr, lm_ptr, -offset, blocks, live, n_blocks, BP)

    @triton.jit
    def store_super_blocks(d_ptr, multiples_ptr, values, blocks, live, n_blocks, BP: tl.constexpr):
        """q4_K / q5_K: a super-block's d = its largest value / 63 in float16, each block's multiple of it."""
        grouped = tl.reshape(values, (BP // 8, 8))
        largest = tl.maximum(tl.max(grouped, axis=1), 0.0)
        factor = tl.where(largest > 0, tl.math.div_rn(tl.full((BP // 8,), 63.0, tl.float32),
                                                      tl.where(largest > 0, largest, 1.0)), 0.0)
        multiples = tl.reshape(nearest(tl.minimum(factor[:, None] * grouped, 63.0)), (BP,))
        supers = tl.program_id(0) * (BP // 8) + tl.arange(0, BP // 8)
        d = tl.math.div_rn(largest, tl.full((BP // 8,), 63.0, tl.float32))
        tl.store(d_ptr + supers, d.to(tl.float16), mask=supers < n_blocks // 8)
        tl.store(multiples_ptr + blocks, multiples.to(tl.int8), mask=live)

    @triton.jit
    def symmetric_sums(x_ptr, blocks, live, inverse):
        """q6_K's candidate grid: sum of w x l and of w l l over a block of 16 (w = x^2), in order."""
        x = column(x_ptr, blocks, live, 0, 16)
        level = nearest(tl.minimum(tl.maximum(inverse * x, -32.0), 31.0))
        sum_lx, sum_l2 = (x * x) * x * level, (x * x) * level * level
        for j in range(1, 16):
            x = column(x_ptr, blocks, live, j, 16)
            level = nearest(tl.minimum(tl.maximum(inverse * x, -32.0), 31.0))
            sum_lx, sum_l2 = sum_lx + (x * x) * x * level, sum_l2 + (x * x) * level * level
        return sum_lx, sum_l2

    @triton.jit
    def q6_k_search_kernel(x_ptr, candidates_ptr, d_ptr, sc_ptr, n_blocks, N_CANDIDATES: tl.constexpr,
                           BP: tl.constexpr):
        """quantizers.q6_k_steps (make_qx_quants' 19 grids, then the super-block's 8-bit scales) for BP blocks."""
        blocks = tl.program_id(0) * BP + tl.arange(0, BP)
        live = blocks < n_blocks
        peak = column(x_ptr, blocks, live, 0, 16)
        for j in range(1, 16):  # the first element of the largest magnitude
            x = column(x_ptr, blocks, live, j, 16)
            peak = tl.where(tl.abs(x) > tl.abs(peak), x, peak)
        safe = tl.where(peak != 0, peak, 1.0)
        sum_lx, sum_l2 = symmetric_sums(x_ptr, blocks, live, tl.math.div_rn(tl.full((BP,), -32.0, tl.float32), safe))
        scale = tl.where(sum_l2 != 0, tl.math.div_rn(sum_lx, tl.where(sum_l2 != 0, sum_l2, 1.0)), 0.0)
        best = scale * sum_lx
        for tried in range(N_CANDIDATES):
            numerator = tl.load(candidates_ptr + tried) + tl.zeros((BP,), tl.float32)
            sum_lx, sum_l2 = symmetric_sums(x_ptr, blocks, live, tl.math.div_rn(numerator, safe))
            better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
            scale = tl.where(better, tl.math.div_rn(sum_lx, tl.where(better, sum_l2, 1.0)), scale)
            best = tl.where(better, scale * sum_lx, best)
        scale = tl.where(tl.abs(peak) < 1e-15, 0.0, scale)
        grouped = tl.reshape(scale, (BP // 16, 16))
        top = signed_absmax(grouped, tl.arange(0, 16), 16)
        zero = tl.abs(top) < 1e-15
        inverse = tl.math.div_rn(tl.full((BP // 16,), -128.0, tl.float32), tl.where(zero, 1.0, top))
        multiples = tl.where(zero[:, None], 0.0, nearest(tl.minimum(inverse[:, None] * grouped, 127.0)))
        d = tl.where(zero, 0.0, tl.math.div_rn(tl.full((BP // 16,), 1.0, tl.float32), inverse))
        supers = tl.program_id(0) * (BP // 16) + tl.arange(0, BP // 16)
        tl.store(d_ptr + supers, d.to(tl.float16), mask=supers < n_blocks // 16)
        tl.store(sc_ptr + blocks, tl.reshape(multiples, (BP,)).to(tl.int8), mask=live)


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
        **LAUNCH_OPTIONS)


@export_rounded.register_fake
def _(out: torch.Tensor, base: torch.Tensor, product: torch.Tensor | None, scale: float, ggml_type: str,
      steps: list[torch.Tensor]) -> None:
    # the planner's fake step: the op's bytes (inputs read, `out` written) are what it prices
    return None


@torch.library.custom_op("qlora_fsdp::export_searched", mutates_args=("steps",))
def export_searched(steps: list[torch.Tensor], merged: torch.Tensor, candidates: torch.Tensor, ggml_type: str) -> None:
    """Write into `steps` (quantizers.empty_steps of these rows) a k-quant's block search of `merged` ([rows, n],
    float32, n a multiple of 256): quantizers.block_steps' values, the candidates' numerators given
    (quantizers.candidate_numerators)."""
    kind, block, number = KINDS[ggml_type]
    n_blocks = merged.numel() // block
    per_program = INTERPRETED_BLOCKS_A_PROGRAM if interpreting() else BLOCKS_A_PROGRAM
    grid = (triton.cdiv(n_blocks, per_program),)
    candidates = candidates.to(merged.device)
    if kind == Q6_K:
        q6_k_search_kernel[grid](merged.contiguous(), candidates, *steps, n_blocks, N_CANDIDATES=candidates.numel(),
                                 BP=per_program, **LAUNCH_OPTIONS)
    else:
        with_min_search_kernel[grid](merged.contiguous(), candidates, *steps, n_blocks, NMAX=number,
                                     NSTEP=candidates.numel() - 1, BP=per_program, **LAUNCH_OPTIONS)


@export_searched.register_fake
def _searched(steps: list[torch.Tensor], merged: torch.Tensor, candidates: torch.Tensor, ggml_type: str) -> None:
    return None
