"""One Triton kernel for a 4-bit linear with its LoRA adapter at decoding's row counts: y = x W^T + s (x A^T) B^T.

bitsandbytes' `gemm_4bit` on 32+ rows dequantizes the nested absmax, then the whole NF4 weight into a bf16 buffer,
then calls cuBLAS: every decoding step writes and re-reads a 16-bit copy of every weight. Here each program reads
the packed bytes and the 8-bit absmax of its tile where bitsandbytes keeps them (no second copy of the weights),
dequantizes in registers (the same two fp32 products bitsandbytes' `dequantize_4bit` computes, so the values are
bit-identical) and multiplies. LoRA's B and the base layer's bias are added in the epilogue by the first split;
`x A^T` (rows x r, a few hundred bytes) is one small matmul beforehand.

Split-K for few rows (decoding's 32-256 rows give a grid too small for a GPU otherwise): each split writes its
fp32 partial and the partials are summed in a fixed order, so the result is deterministic.

Layout (bitsandbytes' Params4bit): W (N x K, row-major) flattened, two elements a byte, the even element in the
high nibble; an absmax per `blocksize` elements, with double quantization an uint8 code into the 256-entry map
`code2`, scaled per 256 absmax blocks by `absmax2` and shifted by `offset`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:  # Triton ships with CUDA builds of torch; the CPU build runs the kernels only under TRITON_INTERPRET=1
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover (the CPU venv installs triton for the tests)
    triton = None
    tl = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class PackedNF4:
    """A Linear4bit's weight as the kernel reads it (views of bitsandbytes' own tensors, nothing copied)."""

    packed: torch.Tensor  # uint8, N * K / 2 bytes
    absmax: torch.Tensor  # float32 per block, or uint8 codes when nested
    code: torch.Tensor  # the 16 NF4 (or FP4) values, float32
    blocksize: int
    shape: tuple[int, int]  # (N, K)
    absmax_code: torch.Tensor | None = None  # nested: code2 (256 float32), absmax2 per 256 blocks, offset
    absmax_scale: torch.Tensor | None = None
    absmax_offset: torch.Tensor | None = None  # float32, one element (read by the kernel: no host sync)
    absmax_blocksize: int = 256


def packed_nf4(weight: torch.Tensor, state: object) -> PackedNF4:
    """The kernel's view of a bitsandbytes QuantState and its packed bytes."""
    nested = bool(getattr(state, "nested", False))
    state2 = getattr(state, "state2", None) if nested else None
    shape = tuple(int(d) for d in state.shape)  # type: ignore[attr-defined]
    return PackedNF4(
        packed=weight.reshape(-1).view(torch.uint8), absmax=state.absmax,  # type: ignore[attr-defined]
        code=state.code.float(), blocksize=int(state.blocksize), shape=(shape[0], shape[1]),  # type: ignore[attr-defined]
        absmax_code=state2.code.float() if state2 is not None else None,
        absmax_scale=state2.absmax.float() if state2 is not None else None,
        absmax_offset=state.offset.reshape(1).float() if nested else None,  # type: ignore[attr-defined]
        absmax_blocksize=int(state2.blocksize) if state2 is not None else 256)


if triton is not None:

    @triton.jit
    def nf4_tile(packed_ptr, absmax_ptr, code_ptr, code2_ptr, absmax2_ptr, offset, rows, cols, K: tl.constexpr,
                 N, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, ABSMAX_BLOCKSIZE: tl.constexpr):
        """W[rows, cols] dequantized in fp32 (rows: output features, cols: input features), zero outside N."""
        inside = (rows < N) & (cols < K)
        element = rows.to(tl.int64) * K + cols
        byte = tl.load(packed_ptr + element // 2, mask=inside, other=0).to(tl.int32)
        nibble = tl.where(element % 2 == 0, byte >> 4, byte & 15)
        block = element // BLOCKSIZE
        if NESTED:
            quantized = tl.load(absmax_ptr + block, mask=inside, other=0).to(tl.int32)
            scale = tl.load(code2_ptr + quantized) * tl.load(absmax2_ptr + block // ABSMAX_BLOCKSIZE, mask=inside,
                                                             other=0.0)
            scale = scale + tl.load(offset)
        else:
            scale = tl.load(absmax_ptr + block, mask=inside, other=0.0)
        return tl.where(inside, tl.load(code_ptr + nibble) * scale, 0.0)

    @triton.jit
    def nf4_dequantize_kernel(out_ptr, packed_ptr, absmax_ptr, code_ptr, code2_ptr, absmax2_ptr, offset, N,
                              K: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                              ABSMAX_BLOCKSIZE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)[:, None]
        cols = tl.program_id(1) * BK + tl.arange(0, BK)[None, :]
        tile = nf4_tile(packed_ptr, absmax_ptr, code_ptr, code2_ptr, absmax2_ptr, offset, rows, cols, K, N,
                        BLOCKSIZE, NESTED, ABSMAX_BLOCKSIZE)
        tl.store(out_ptr + rows * K + cols, tile.to(out_ptr.dtype.element_ty), mask=(rows < N) & (cols < K))

    @triton.jit
    def nf4_lora_matmul_kernel(
            out_ptr, x_ptr, packed_ptr, absmax_ptr, code_ptr, code2_ptr, absmax2_ptr, offset, xa_ptr, b_ptr,
            bias_ptr, lora_scale, M, N, K: tl.constexpr, R: tl.constexpr, K_SPLIT: tl.constexpr,
            BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, ABSMAX_BLOCKSIZE: tl.constexpr, HAS_LORA: tl.constexpr,
            HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            BR: tl.constexpr):
        """Program (m, n, s): rows m*BM.., outputs n*BN.., K's split s; writes fp32 partial s of out[M, N]."""
        pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BM + tl.arange(0, BM)
        outputs = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for step in range(0, K_SPLIT, BK):
            cols = split * K_SPLIT + step + tl.arange(0, BK)
            x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < K),
                        other=0.0)
            w = nf4_tile(packed_ptr, absmax_ptr, code_ptr, code2_ptr, absmax2_ptr, offset, outputs[None, :],
                         cols[:, None], K, N, BLOCKSIZE, NESTED, ABSMAX_BLOCKSIZE)
            if UPCAST:  # fp32 operands: the interpreter multiplies bf16's raw bits; fp32 inputs stay exact
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        if split == 0:
            if HAS_LORA:
                ranks = tl.arange(0, BR)
                xa = tl.load(xa_ptr + rows[:, None] * R + ranks[None, :],
                             mask=(rows[:, None] < M) & (ranks[None, :] < R), other=0.0)
                b = tl.load(b_ptr + outputs[None, :] * R + ranks[:, None],
                            mask=(outputs[None, :] < N) & (ranks[:, None] < R), other=0.0)
                acc += tl.dot(xa.to(tl.float32), b.to(tl.float32), input_precision="ieee") * lora_scale
            if HAS_BIAS:
                acc += tl.load(bias_ptr + outputs, mask=outputs < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + split * M * N + rows[:, None] * N + outputs[None, :], acc,
                 mask=(rows[:, None] < M) & (outputs[None, :] < N))


def kernel_args(weight: PackedNF4) -> tuple[torch.Tensor, ...]:
    """(absmax, code, code2, absmax2, offset): the code's tensor in the places a weight that is not nested lacks."""
    def or_code(tensor: torch.Tensor | None) -> torch.Tensor:
        return tensor if tensor is not None else weight.code
    return weight.absmax, weight.code, or_code(weight.absmax_code), or_code(weight.absmax_scale), \
        or_code(weight.absmax_offset)


def dequantize(weight: PackedNF4, dtype: torch.dtype = torch.float32, block_n: int = 16,
               block_k: int = 64) -> torch.Tensor:
    """The whole weight (N x K) through the kernel's own dequantization: what the matmul multiplies by."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.packed.device)
    absmax, code, code2, absmax2, offset = kernel_args(weight)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    nf4_dequantize_kernel[grid](out, weight.packed, absmax, code, code2, absmax2, offset, n, k, weight.blocksize,
                                weight.absmax_code is not None, weight.absmax_blocksize, block_n, block_k)
    return out


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and K's splits; a GPU wants BM >= 16 for tl.dot, and enough programs to fill its SMs."""

    bm: int = 16
    bn: int = 64
    bk: int = 64
    splits: int = 1


def tiles_for(rows: int, n: int, k: int, programs_wanted: int = 256, interpreted: bool | None = None) -> Tiles:
    """Few rows: narrow-N tiles and K split until the grid has about `programs_wanted` programs (an H200 has 132
    SMs; two programs each hide the loads' latency). Interpreted (a CPU), few large tiles: the interpreter pays
    per program, not per element."""
    if interpreting() if interpreted is None else interpreted:
        return Tiles(max(16, triton.next_power_of_2(rows)), min(triton.next_power_of_2(n), 256),
                     min(triton.next_power_of_2(k), 256), 1)
    bm = 16 if rows <= 16 else 32 if rows <= 32 else 64
    bn, bk = 64, 128 if k % 128 == 0 else 64
    programs = triton.cdiv(rows, bm) * triton.cdiv(n, bn)
    splits = 1
    while programs * splits * 2 <= programs_wanted and k % (bk * splits * 2) == 0 and k // (splits * 2) >= 4 * bk:
        splits *= 2
    return Tiles(bm, bn, bk, splits)


def nf4_lora_matmul(x: torch.Tensor, weight: PackedNF4, lora_a: torch.Tensor | None = None,
                    lora_b: torch.Tensor | None = None, lora_scale: float = 1.0, bias: torch.Tensor | None = None,
                    tiles: Tiles | None = None) -> torch.Tensor:
    """x (..., K) -> (..., N) in x's dtype: x W^T + lora_scale (x A^T) B^T + bias. A: (r, K), B: (N, r)."""
    n, k = weight.shape
    flat = x.reshape(-1, k).contiguous()
    m = flat.shape[0]
    tiles = tiles or tiles_for(m, n, k)
    lora = lora_a is not None and lora_b is not None
    xa = (flat @ lora_a.to(flat.dtype).t()).float().contiguous() if lora else flat  # type: ignore[union-attr]
    b = lora_b.contiguous() if lora else flat  # type: ignore[union-attr]
    rank = b.shape[1] if lora else 1
    partial = torch.empty(tiles.splits, m, n, dtype=torch.float32, device=x.device)
    absmax, code, code2, absmax2, offset = kernel_args(weight)
    grid = (triton.cdiv(m, tiles.bm), triton.cdiv(n, tiles.bn), tiles.splits)
    nf4_lora_matmul_kernel[grid](
        partial, flat, weight.packed, absmax, code, code2, absmax2, offset, xa, b,
        bias if bias is not None else flat, float(lora_scale), m, n, k, rank, k // tiles.splits, weight.blocksize,
        weight.absmax_code is not None, weight.absmax_blocksize, lora, bias is not None,
        flat.dtype == torch.float32 or interpreting(), tiles.bm, tiles.bn, tiles.bk,
        max(16, triton.next_power_of_2(rank)))
    out = partial[0] if tiles.splits == 1 else partial.sum(0)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
