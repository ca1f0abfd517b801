"""llama.cpp's quantizers as rounding in torch: a weight in, the values llama.cpp's GGUF will hold for it out.

`export.target` trains the adapter through the export: each weight the forward reads is the merged weight as
llama.cpp's quantizer stores it (q8_0, q4_0, q5_0, q4_K, q5_K, q6_K: the types q4_k_m, q5_k_m, q4_0 and q8_0 files
are made of; and q5_1, q5_K's fallback). Rounding that only resembles the export's gains nothing (pytorch/ao#2419),
so each function here follows llama.cpp's reference quantizer (ggml-quants.c without an importance matrix: what
llama-quantize runs without --imatrix) step for step in float32: the same sums in the same order (llama.cpp adds a
block's elements one after another; a tree sum rounds differently and can pick another scale), the same divisions,
its rounding (`nearest_int`: to even; q8_0's `roundf`: away from zero; q4_0's truncation after adding 8.5) and the
scales stored in float16. tests/test_export_target.py holds every type to llama.cpp's own library, value for value,
on real weights.

Rows are the weight's rows (llama.cpp quantizes along the input dimension: blocks of 32, super-blocks of 256), so
a weight is rounded in chunks of whole rows: a search holds several float32 copies of what it searches (q4_K about
ten), and a chunk bounds them (CHUNK_ELEMENTS) where a whole 8B down projection would need gigabytes. The additions
walk a block's elements in order, so a chunk costs a few thousand vector operations whatever its size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

QK_K = 256  # a k-quant's super-block
GROUP_MAX_EPS = 1e-15  # below this, llama.cpp takes a q6_K block for all zeros
CHUNK_ELEMENTS = 1 << 24  # rows rounded together: 64 MB a float32 copy
Steps = tuple[torch.Tensor, ...]


def f32(value: float) -> torch.Tensor:
    """A C float constant (0.1f is not 0.1). A number over a tensor is written f32(number) / tensor: torch computes
    `number / tensor` as the tensor's reciprocal times the number, which rounds twice."""
    return torch.tensor(value, dtype=torch.float32)


def as_half(x: torch.Tensor) -> torch.Tensor:
    """A scale stored in float16 and read back (GGML_FP32_TO_FP16: to nearest, ties to even)."""
    return x.to(torch.float16).to(torch.float32)


def nearest_int(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's nearest_int (adding 1.5 * 2^23 and reading the mantissa): to nearest, ties to even."""
    return torch.round(x)


def roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (x - trunc(x) is exact, so no addition rounds first)."""
    whole = torch.trunc(x)
    return whole + torch.sign(x) * ((x - whole).abs() >= 0.5)


def ordered_sum(terms: torch.Tensor) -> torch.Tensor:
    """Sum over the elements ([..., elements, blocks]) one after another, as a C loop adds in float32."""
    total = terms[..., 0, :]
    for index in range(1, terms.shape[-2]):
        total = total + terms[..., index, :]
    return total


def signed_absmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Each block's value of largest magnitude, the first one where several tie (llama.cpp's `amax < fabsf(v)`)."""
    return x.gather(dim, x.abs().argmax(dim=dim, keepdim=True)).squeeze(dim)


def blocks_of(w: torch.Tensor, size: int) -> torch.Tensor:
    if w.ndim != 2 or w.shape[1] % size:
        raise ValueError(f"a [rows, n] weight with n a multiple of {size} is needed, got {tuple(w.shape)}")
    return w.float().reshape(-1, size)


def elements_first(w: torch.Tensor, size: int) -> torch.Tensor:
    """Blocks as [elements, blocks]: the in-order sums then add whole contiguous rows."""
    return blocks_of(w, size).t().contiguous()


def q8_0(w: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_0_ref: blocks of 32, d = absmax / 127, q = roundf(x / d) (gguf-py's q8_0 is the same)."""
    x = blocks_of(w, 32)
    d = x.abs().amax(dim=-1, keepdim=True) / f32(127)
    inverse = torch.where(d != 0, f32(1) / d, torch.zeros_like(d))
    return (roundf(x * inverse) * as_half(d)).reshape(w.shape)


def symmetric_4_or_5(w: torch.Tensor, half_range: int) -> torch.Tensor:
    """q4_0 (half_range 8) and q5_0 (16): d = the block's signed absmax / -half_range, q = trunc(x / d + half + .5)."""
    x = blocks_of(w, 32)
    d = (signed_absmax(x) / f32(-half_range)).unsqueeze(-1)
    inverse = torch.where(d != 0, f32(1) / d, torch.zeros_like(d))
    q = torch.trunc(x * inverse + (half_range + 0.5)).clamp(max=2 * half_range - 1)
    return ((q - half_range) * as_half(d)).reshape(w.shape)


def q4_0(w: torch.Tensor) -> torch.Tensor:
    return symmetric_4_or_5(w, 8)


def q5_0(w: torch.Tensor) -> torch.Tensor:
    return symmetric_4_or_5(w, 16)


def q5_1(w: torch.Tensor) -> torch.Tensor:
    """quantize_row_q5_1_ref (q5_K's fallback for rows not a multiple of 256): blocks of 32 from min to max,
    q = trunc((x - min) / d + .5) with the unrounded d and min, both then stored in float16."""
    x = blocks_of(w, 32)
    low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    d = (high - low) / f32(31)
    inverse = torch.where(d != 0, f32(1) / d, torch.zeros_like(d))
    q = torch.trunc((x - low) * inverse + 0.5)
    return (q * as_half(d) + as_half(low)).reshape(w.shape)


def search_scale_and_min(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float,
                         nstep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qkx2_quants (squared error) for blocks x [n, B]: the scale and the min (as llama.cpp returns it: minus
    the offset) of the best of nstep + 1 candidate grids, each fitted by weighted least squares. Each candidate's
    grid starts at the best offset so far, so the candidates run one after another."""
    offset = torch.minimum(x.amin(dim=0), torch.zeros(()))
    high = x.amax(dim=0)
    sum_w, sum_x = ordered_sum(torch.stack([weights, weights * x]))
    flat = high == offset  # llama.cpp: scale 0, min minus the offset
    ones = torch.ones_like(high)

    def grid(inverse_scale: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return nearest_int(inverse_scale * (x - start)).clamp(0, nmax)

    def weighted_error(scale: torch.Tensor, start: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        diff = scale * levels + start - x
        return ordered_sum(weights * (diff * diff))

    inverse = f32(nmax) / torch.where(flat, ones, high - offset)
    scale = f32(1) / inverse
    best_error = weighted_error(scale, offset, grid(inverse, offset))
    for numerator in with_min_numerators(nmax, rmin, rdelta, nstep):
        span = torch.where(flat, ones, high - offset)
        levels = grid(numerator / span, offset)
        weighted = weights * levels
        sum_l, sum_l2, sum_xl = ordered_sum(torch.stack([weighted, weighted * levels, weighted * x]))
        det = sum_w * sum_l2 - sum_l * sum_l
        usable = det > 0
        det = torch.where(usable, det, ones)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_offset = (sum_l2 * sum_x - sum_l * sum_xl) / det
        clipped = this_offset > 0  # the grid may not start above zero: the scale refitted alone
        this_scale = torch.where(clipped, sum_xl / torch.where(clipped, sum_l2, ones), this_scale)
        this_offset = torch.where(clipped, torch.zeros_like(this_offset), this_offset)
        error = weighted_error(this_scale, this_offset, levels)
        better = usable & (error < best_error) & ~flat  # the first strictly better candidate wins
        best_error = torch.where(better, error, best_error)
        scale = torch.where(better, this_scale, scale)
        offset = torch.where(better, this_offset, offset)
    return torch.where(flat, torch.zeros_like(scale), scale), -offset


# q4_K and q5_K: (nmax, rmin, nstep) of their block search
WITH_MIN = {"q4_K": (15, -1.0, 20), "q5_K": (31, -0.5, 15)}


def with_min_numerators(nmax: int, rmin: float, rdelta: float, nstep: int) -> torch.Tensor:
    """make_qkx2_quants' candidates: iscale = (rmin + rdelta * step + nmax) / span, the numerators in float32."""
    return torch.stack([f32(rmin) + f32(rdelta) * step + nmax for step in range(nstep + 1)])


def symmetric_numerators(nmax: int) -> torch.Tensor:
    """make_qx_quants' 18 further grids, in llama.cpp's order: iscale = -(nmax + 0.1 * tried) / peak."""
    return torch.stack([-(nmax + f32(0.1) * tried) for tried in (*range(-9, 0), *range(1, 10))])


def candidate_numerators(ggml_type: str) -> torch.Tensor:
    if ggml_type == "q6_K":
        return symmetric_numerators(32)
    nmax, rmin, nstep = WITH_MIN[ggml_type]
    return with_min_numerators(nmax, rmin, 0.1, nstep)


def steps_with_min(w: torch.Tensor, ggml_type: str) -> Steps:
    """quantize_row_q4_K_ref / q5_K's search: super-blocks of 8 blocks of 32, each block's scale and min searched,
    both then stored as 6-bit multiples of the super-block's float16 d and dmin; as stored: (d, the scales'
    multiples, dmin, the mins' multiples), a row each."""
    nmax, rmin, nstep = WITH_MIN[ggml_type]
    x = elements_first(w, 32)
    av_x = torch.sqrt(ordered_sum(x * x) / f32(32))
    scales, mins = search_scale_and_min(x, av_x + x.abs(), nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(-1, QK_K // 32), mins.reshape(-1, QK_K // 32)
    max_scale = scales.amax(dim=-1, keepdim=True).clamp(min=0)
    max_min = mins.amax(dim=-1, keepdim=True).clamp(min=0)
    ls = nearest_int(torch.where(max_scale > 0, f32(63) / max_scale, 0) * scales).clamp(max=63)
    lm = nearest_int(torch.where(max_min > 0, f32(63) / max_min, 0) * mins).clamp(max=63)
    return stored(w, max_scale / f32(63), ls) + stored(w, max_min / f32(63), lm)


def stored(w: torch.Tensor, d: torch.Tensor, multiples: torch.Tensor) -> Steps:
    """A super-block's float16 d and its blocks' small integer multiples of it, a row of `w` each: what the GGUF
    stores (0.07-0.08 bytes a weight, where the float32 steps take 0.25), and exactly the steps once multiplied."""
    rows = w.shape[0]
    return d.to(torch.float16).reshape(rows, -1), multiples.to(torch.int8).reshape(rows, -1)


def block_values(d: torch.Tensor, multiples: torch.Tensor) -> torch.Tensor:
    """Each block's step (or offset) from stored(): d times its multiple in float32, as the dequantizer forms it."""
    per_super = multiples.shape[-1] // d.shape[-1]
    return (d.float().unsqueeze(-1) * multiples.float().reshape(*d.shape, per_super)).reshape(-1)


def with_min(w: torch.Tensor, ggml_type: str, d: torch.Tensor, ls: torch.Tensor, dmin: torch.Tensor,
             lm: torch.Tensor) -> torch.Tensor:
    """q4_K / q5_K values from the stored steps: q = nearest((x + offset) / step) in [0, nmax]."""
    step, offset = block_values(d, ls).unsqueeze(-1), block_values(dmin, lm).unsqueeze(-1)
    x = blocks_of(w, 32)
    q = nearest_int((x + offset) / torch.where(step != 0, step, torch.ones_like(step))).clamp(0, WITH_MIN[ggml_type][0])
    return (step * q - offset).reshape(w.shape)


def symmetric_block_scale(x: torch.Tensor, nmax: int) -> torch.Tensor:
    """make_qx_quants with weights x^2 (rmse_type 1) for blocks x [n, B]: the best of 19 grids around nmax / max,
    tried one after another (all at once would hold 19 copies of the blocks)."""
    peak = signed_absmax(x, dim=0)
    safe_peak = torch.where(peak != 0, peak, torch.ones_like(peak))
    weights = x * x

    def sums(inverse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        levels = nearest_int(inverse * x).clamp(-nmax, nmax - 1)
        sum_lx, sum_l2 = ordered_sum(torch.stack([weights * x * levels, weights * levels * levels]))
        return sum_lx, sum_l2

    sum_lx, sum_l2 = sums(f32(-nmax) / safe_peak)
    scale = torch.where(sum_l2 != 0, sum_lx / torch.where(sum_l2 != 0, sum_l2, torch.ones_like(sum_l2)), 0)
    best = scale * sum_lx
    for numerator in symmetric_numerators(nmax):  # the first candidate that beats the best so far
        sum_lx, sum_l2 = sums(numerator / safe_peak)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        scale = torch.where(better, sum_lx / torch.where(better, sum_l2, 1), scale)
        best = torch.where(better, scale * sum_lx, best)
    return torch.where(peak.abs() < GROUP_MAX_EPS, torch.zeros_like(scale), scale)


def q6_k_steps(w: torch.Tensor) -> Steps:
    """quantize_row_q6_K_ref's search: super-blocks of 16 blocks of 16, each block's signed scale searched, stored
    as an 8-bit multiple of the super-block's float16 d; as stored: (d, the multiples), a row each."""
    scales = symmetric_block_scale(elements_first(w, 16), 32).reshape(-1, QK_K // 16)
    peak = signed_absmax(scales).unsqueeze(-1)
    zero = peak.abs() < GROUP_MAX_EPS
    inverse = f32(-128) / torch.where(zero, torch.ones_like(peak), peak)
    sc = nearest_int(inverse * scales).clamp(max=127)
    return stored(w, torch.where(zero, 0, f32(1) / inverse), torch.where(zero, 0, sc))


def with_q6_k_steps(w: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """q6_K values from the stored steps: q = nearest(x / step) in [-32, 31]."""
    x, step = blocks_of(w, 16), block_values(d, sc).unsqueeze(-1)
    q = nearest_int(x / torch.where(step != 0, step, torch.ones_like(step))).clamp(-32, 31)
    return (step * q).reshape(w.shape)


SEARCHED = ("q4_K", "q5_K", "q6_K")  # a block search, then a cheap rounding by its result
SINGLE_PASS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "q8_0": q8_0, "q4_0": q4_0, "q5_0": q5_0, "q5_1": q5_1}
TYPES = (*SINGLE_PASS, *SEARCHED)


def row_slices(w: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
    """Whole rows, at most CHUNK_ELEMENTS a chunk (one row where a row is longer): (their rows, the chunk)."""
    chunks = w.split(max(1, CHUNK_ELEMENTS // max(1, w.shape[-1])))
    starts = [0, *itertools.accumulate(chunk.shape[0] for chunk in chunks)]
    return [(slice(start, start + chunk.shape[0]), chunk) for start, chunk in zip(starts, chunks, strict=False)]


def chunk_steps(w: torch.Tensor, ggml_type: str) -> Steps:
    return q6_k_steps(w) if ggml_type == "q6_K" else steps_with_min(w, ggml_type)


def empty_steps(w: torch.Tensor, ggml_type: str) -> Steps:
    """Room for a searched type's stored steps of the whole of `w` (stored()); () for the types without a search."""
    if ggml_type not in SEARCHED:
        return ()
    rows, cols = w.shape
    block = 16 if ggml_type == "q6_K" else 32
    pairs = 1 if ggml_type == "q6_K" else 2
    return tuple(torch.empty((rows, cols // size), dtype=dtype, device=w.device) for _ in range(pairs)
                 for size, dtype in ((QK_K, torch.float16), (block, torch.int8)))


def block_steps(w: torch.Tensor, ggml_type: str) -> Steps | None:
    """A k-quant's searched block steps, as stored (q4_K, q5_K: d, scales, dmin, mins; q6_K: d, scales), the
    costly part of its rounding, searched a chunk of rows at a time; None for the types without a search."""
    if ggml_type not in SEARCHED:
        return None
    steps = empty_steps(w, ggml_type)
    for rows, chunk in row_slices(w):
        for whole, part in zip(steps, chunk_steps(chunk, ggml_type), strict=True):
            whole[rows] = part
    return steps


def rounded_chunk(w: torch.Tensor, ggml_type: str, steps: Steps) -> torch.Tensor:
    if ggml_type in SINGLE_PASS:
        return SINGLE_PASS[ggml_type](w)
    return with_q6_k_steps(w, *steps) if ggml_type == "q6_K" else with_min(w, ggml_type, *steps)


def rounded(w: torch.Tensor, ggml_type: str, steps: Steps | None = None) -> torch.Tensor:
    """`w` ([rows, n], the GGUF's float16 values) as llama.cpp stores it in `ggml_type`, read back in float32; a
    k-quant's `steps` where they were searched already for this very `w` (block_steps)."""
    if ggml_type in ("f16", "f32"):
        return w.float()
    if ggml_type in SEARCHED:
        steps = steps or block_steps(w, ggml_type)
        assert steps is not None
    out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    for rows, chunk in row_slices(w):
        out[rows] = rounded_chunk(chunk, ggml_type, tuple(s[rows] for s in steps or ()))
    return out
