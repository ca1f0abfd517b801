"""Decoding's attention over the live part of a static KV cache: one query a row, grouped-query heads read once.

transformers' sdpa path for a decoding step expands every key/value head to its query heads (`repeat_kv`, a copy
of the whole cache a layer) and scores every slot of the static cache, filled or not (320 slots for a row of 257
tokens). Here a program takes one row and one key/value head, with that head's group of queries, and walks the
cache in blocks up to the filled length, which it reads from the cache's own device counter (so a CUDA graph
replays it unchanged as the cache grows); the blocks past it are neither read nor scored. Softmax is the online
one in fp32. Padding (left-padded prompts) comes from the row's mask.

Sliding windows, soft-capping and attention sinks are not here: those families decode through today's path.
"""

from __future__ import annotations

import torch

from qlora_fsdp.kernels.nf4_matmul import tl, triton

if triton is not None:

    @triton.jit
    def decode_attention_kernel(out_ptr, q_ptr, k_ptr, v_ptr, valid_ptr, length_ptr, scaling,
                                HQ: tl.constexpr, HKV: tl.constexpr, L: tl.constexpr, D: tl.constexpr,
                                G: tl.constexpr, BG: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr,
                                HAS_VALID: tl.constexpr):
        row, head = tl.program_id(0), tl.program_id(1)
        group = tl.arange(0, BG)
        dims = tl.arange(0, BD)
        q_heads = head * G + group
        q = tl.load(q_ptr + (row * HQ + q_heads[:, None]) * D + dims[None, :],
                    mask=(group[:, None] < G) & (dims[None, :] < D), other=0.0).to(tl.float32)
        length = tl.load(length_ptr)
        best = tl.full((BG,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BG,), dtype=tl.float32)
        acc = tl.zeros((BG, BD), dtype=tl.float32)
        base = (row * HKV + head) * L
        for start in range(0, L, BL):
            if start < length:  # the cache's unfilled blocks are never read
                slots = start + tl.arange(0, BL)
                live = slots < length
                if HAS_VALID:
                    live = live & (tl.load(valid_ptr + row * L + slots, mask=slots < L, other=0) != 0)
                keys = tl.load(k_ptr + (base + slots[:, None]) * D + dims[None, :],
                               mask=live[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
                scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scaling
                scores = tl.where(live[None, :], scores, float("-inf"))
                new_best = tl.maximum(best, tl.max(scores, axis=1))
                safe = tl.where(new_best == float("-inf"), 0.0, new_best)  # a block of padding only
                weights = tl.exp(scores - safe[:, None])
                rescale = tl.exp(best - safe)
                values = tl.load(v_ptr + (base + slots[:, None]) * D + dims[None, :],
                                 mask=live[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
                acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
                total = total * rescale + tl.sum(weights, axis=1)
                best = new_best
        out = acc / total[:, None]
        tl.store(out_ptr + (row * HQ + q_heads[:, None]) * D + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(group[:, None] < G) & (dims[None, :] < D))


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor,
                     valid: torch.Tensor | None, scaling: float, block: int = 32) -> torch.Tensor:
    """query (B, Hq, 1, D); keys, values (B, Hkv, L, D), a static cache filled to `length` (a 0-d int tensor on
    the device); valid (B, L) booleans (padding False) or None. Returns (B, 1, Hq, D), transformers' layout."""
    rows, q_heads, _, dim = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    out = torch.empty(rows, 1, q_heads, dim, dtype=query.dtype, device=query.device)
    valid_bytes = valid.to(torch.uint8).contiguous() if valid is not None else length
    decode_attention_kernel[(rows, kv_heads)](
        out, query.contiguous(), keys.contiguous(), values.contiguous(), valid_bytes, length.reshape(1),
        float(scaling), q_heads, kv_heads, slots, dim, group, max(triton.next_power_of_2(group), 1), block,
        triton.next_power_of_2(dim), valid is not None)
    return out
