"""Exact attention in memory linear in the row: causal, sliding windows, soft-capping and sinks, forward and
backward, never holding more than one block of scores.

The forward walks the keys a block at a time with a running maximum and sum (the online softmax of flash
attention) and keeps only each query's log-sum-exp; the backward recomputes a block's probabilities from it. A
block pair that the causal mask or the window leaves empty is skipped, so a window of w costs rows x w, not
rows squared. Sinks (gpt-oss) are one more logit per head in every softmax with no value: the running sum
starts with it. Soft-capping (Gemma 2) is applied to each block's scores, and its derivative in the backward.

torch's flex attention computes the same on CUDA, but has no CPU backward in torch 2.13; this kernel is the CPU
path and the reference the CUDA path is held to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

# scores of one block: 64 query heads x 512 x 512 x 4 bytes = 64 MiB at most; small rows take one block
BLOCK_TOKENS = 512
# matmul FLOPs a score of one query head, per unit of head size: q.k and p.v forward; the backward recomputes q.k,
# then dp = dO.v, dV, dQ and dK
FORWARD_FLOPS, BACKWARD_FLOPS = 4, 10


@dataclass(frozen=True)
class ScoreRule:
    """What turns a block's raw products into the softmax's logits, and which pairs it sees."""

    scaling: float
    window: int | None  # a query sees itself and the window-1 tokens before it
    softcap: float | None

    def key_start(self, query_start: int) -> int:
        """The first key any query from query_start on may see."""
        return 0 if self.window is None else max(0, query_start - self.window + 1)

    def logits(self, query: torch.Tensor, key: torch.Tensor, rows: range,
               cols: range) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., len(rows), len(cols)] scores after soft-capping (the backward's derivative reads them), and the
        logits: those scores, -inf where the mask hides the pair."""
        scores = (query @ key.transpose(-1, -2)) * self.scaling
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        hidden = self.hidden(rows, cols, query.device)
        return scores, (scores if hidden is None else scores.masked_fill(hidden, float("-inf")))

    def hidden(self, rows: range, cols: range, device: torch.device) -> torch.Tensor | None:
        """The pairs the causal mask and the window hide; None when the block has none."""
        causal_clear = cols.stop - 1 <= rows.start
        window_clear = self.window is None or cols.start > rows.stop - 1 - self.window
        if causal_clear and window_clear:
            return None
        row = torch.arange(rows.start, rows.stop, device=device)[:, None]
        col = torch.arange(cols.start, cols.stop, device=device)[None, :]
        hide = col > row
        return hide if self.window is None else hide | (col <= row - self.window)


def key_blocks(rule: ScoreRule, rows: range, n_tokens: int, block: int) -> list[range]:
    """The key blocks a query block meets: from the window's start to its own last token."""
    start = rule.key_start(rows.start)
    return [range(c, min(c + block, rows.stop)) for c in range(start, rows.stop, block)]


def query_blocks(n_tokens: int, block: int) -> list[range]:
    return [range(r, min(r + block, n_tokens)) for r in range(0, n_tokens, block)]


@torch.library.custom_op("qlora_fsdp::skipped_attention_work", mutates_args=())
def skipped_attention_work(query: torch.Tensor, scores: int, flops_a_score: int) -> None:
    """Nothing at run time: under the planner's fake tensors, the scores of the block pairs it skipped, which its op
    counter (measure/op_work.py) prices as attention FLOPs."""


@skipped_attention_work.register_fake
def _(query: torch.Tensor, scores: int, flops_a_score: int) -> None:
    return None


def block_pairs(rule: ScoreRule, n_tokens: int, block: int, query: torch.Tensor,
                flops_a_score: int) -> list[tuple[range, list[range]]]:
    """Each query block with the key blocks it meets. The planner's fake tensors (no values) take the first pair
    only: every pair allocates and frees the same transients, so one pair reaches the loop's peak, and a 64k-token
    row plans in a step, not in the 8,000 pairs of a full-attention layer; the others' work is handed to the
    planner's counter (`flops_a_score` per score of a query head: 4 x head size forward, 10 x backward)."""
    pairs = [(rows, key_blocks(rule, rows, n_tokens, block)) for rows in query_blocks(n_tokens, block)]
    if not is_fake(query):
        return pairs
    first = (pairs[0][0], pairs[0][1][:1])
    scores = sum(len(rows) * len(cols) for rows, blocks in pairs for cols in blocks)
    skipped = scores - len(first[0]) * len(first[1][0])
    if skipped:
        skipped_attention_work(query, skipped, flops_a_score * query.shape[-1])
    return [first]


def grouped(tensor: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[batch, heads, tokens, dim] -> [batch, kv_heads, group, tokens, dim], a view: grouped queries share a key head
    without copies of the keys."""
    batch, heads, tokens, dim = tensor.shape
    return tensor.reshape(batch, kv_heads, heads // kv_heads, tokens, dim)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16 and fp16 inputs (as eager attention's softmax), float64 kept (the tests' references)."""
    return torch.promote_types(dtype, torch.float32)


def part(tensor: torch.Tensor, span: range, dtype: torch.dtype) -> torch.Tensor:
    """One block of tokens (dim -2) in the compute dtype: only a block is ever held in fp32, never the row."""
    return tensor[..., span.start : span.stop, :].to(dtype)


class BlockwiseAttention(torch.autograd.Function):
    """What outlives a call: the inputs, the output and each query's log-sum-exp (fp32), nothing the size of the row
    in fp32; the backward holds fp32 gradients of the keys and values (the grouped heads') beside one block."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor | None,
                rule: ScoreRule, block: int) -> torch.Tensor:
        kv_heads, n_tokens, dtype = key.shape[1], query.shape[2], compute_dtype(query.dtype)
        q, k, v = grouped(query, kv_heads), key[:, :, None], value[:, :, None]
        out = query.new_empty(query.shape)
        lse = torch.empty(q.shape[:-1], dtype=dtype, device=q.device)
        sink = None if sinks is None else sinks.to(dtype).reshape(1, kv_heads, -1, 1)
        for rows, cols_list in block_pairs(rule, n_tokens, block, query, FORWARD_FLOPS):
            q_block = part(q, rows, dtype)
            if sink is None:
                peak = torch.full(q_block.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
                total = torch.zeros_like(peak)
            else:  # the sink's logit is one more term of every softmax: exp(sink - sink) = 1
                peak = sink.expand(*q_block.shape[:-1]).clone()
                total = torch.ones_like(peak)
            acc = torch.zeros_like(q_block)
            for cols in cols_list:
                _, logits = rule.logits(q_block, part(k, cols, dtype), rows, cols)
                new_peak = torch.maximum(peak, logits.amax(-1))
                # a row the window hides from every key so far keeps -inf: shift by 0 there, not by -inf (NaN)
                shift = new_peak.masked_fill(new_peak == float("-inf"), 0.0)
                decay = torch.exp(peak - shift)
                probs = torch.exp(logits - shift[..., None])
                total = total * decay + probs.sum(-1)
                acc = acc * decay[..., None] + probs @ part(v, cols, dtype)
                peak = new_peak
            grouped(out, kv_heads)[..., rows.start : rows.stop, :] = acc / total[..., None]
            lse[..., rows.start : rows.stop] = peak + torch.log(total)
        ctx.save_for_backward(query, key, value, sinks, out, lse)
        ctx.rule, ctx.block = rule, block
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, sinks, out, lse = ctx.saved_tensors
        rule, block = ctx.rule, ctx.block
        kv_heads, n_tokens, dtype = key.shape[1], query.shape[2], compute_dtype(query.dtype)
        q, k, v = grouped(query, kv_heads), key[:, :, None], value[:, :, None]
        o, d_out = grouped(out, kv_heads), grouped(grad_out, kv_heads)
        d_query = query.new_empty(query.shape)
        d_k = torch.zeros(key.shape, dtype=dtype, device=q.device)
        d_v = torch.zeros_like(d_k)
        sink_mass = torch.zeros(lse.shape[1:3], dtype=dtype, device=q.device)  # sum of p_sink * D over queries
        for rows, cols_list in block_pairs(rule, n_tokens, block, query, BACKWARD_FLOPS):
            r = slice(rows.start, rows.stop)
            q_block, d_out_block = part(q, rows, dtype), part(d_out, rows, dtype)
            # D_i = sum_j p_ij dp_ij = dO_i . O_i (the sink's value is zero, so it adds nothing)
            d_sum = (d_out_block * part(o, rows, dtype)).sum(-1)
            d_q = torch.zeros_like(q_block)
            for cols in cols_list:
                c = slice(cols.start, cols.stop)
                k_block = part(k, cols, dtype)
                capped, logits = rule.logits(q_block, k_block, rows, cols)
                probs = torch.exp(logits - lse[..., r, None])
                d_v[..., c, :] += (probs.transpose(-1, -2) @ d_out_block).sum(2)
                d_logits = probs * (d_out_block @ part(v, cols, dtype).transpose(-1, -2) - d_sum[..., None])
                if rule.softcap is not None:
                    d_logits = d_logits * (1 - (capped / rule.softcap) ** 2)
                d_logits = d_logits * rule.scaling
                d_q += d_logits @ k_block
                d_k[..., c, :] += (d_logits.transpose(-1, -2) @ q_block).sum(2)
            grouped(d_query, kv_heads)[..., r, :] = d_q
            if sinks is not None:
                sink_mass += (torch.exp(sinks.to(dtype).reshape(1, kv_heads, -1, 1) - lse[..., r]) * d_sum).sum(
                    dim=(0, 3))
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            d_sinks = (-sink_mass).reshape(sinks.shape).to(sinks.dtype)
        return d_query, d_k.to(key.dtype), d_v.to(value.dtype), d_sinks, None, None


def blockwise_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                        window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
                        block: int | None = None) -> torch.Tensor:
    """Causal attention of [batch, heads, tokens, dim] (keys and values with fewer heads for grouped queries),
    as transformers' eager attention computes it for the family, in memory linear in the tokens."""
    rule = ScoreRule(scaling if scaling is not None else 1 / math.sqrt(query.shape[-1]), window, softcap)
    return BlockwiseAttention.apply(query, key, value, sinks, rule, block or BLOCK_TOKENS)
