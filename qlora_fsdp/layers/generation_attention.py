"""Generation's attention for the families sdpa cannot compute (Gemma 2's soft-capping, gpt-oss' sinks): the
prompt's forward in memory linear in its length, the decoding steps as transformers' eager attention.

transformers' eager attention scores every query of a prompt against every key in fp32 (a gpt-oss prompt of 16k
tokens: 64 heads x 16k x 16k x 4 bytes, 64 GiB a layer). Here the prompt's forward (queries from an empty cache)
runs each row's real tokens (prompts are left-padded) through the blockwise kernel training uses, windows,
soft-capping and sinks included; a decoding step (one query a row against the cache: scores linear in the cache)
runs the family's own eager function. transformers builds the masks as for sdpa (booleans), which this reads for
each row's padding and to tell a prompt's forward from a later one; it leaves them out where sdpa's causal flag
(queries from the cache's first key) is the mask.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from qlora_fsdp.config.schema import AttnImplementation
from qlora_fsdp.families import CAUSAL_ONLY, AttentionNeeds
from qlora_fsdp.layers.attention import AttentionOptions, family_attention
from qlora_fsdp.layers.flex_attention import REGISTERED_FLEX

BLOCKWISE_GENERATION = "blockwise_generation"


def generation_attention(choice: AttnImplementation, needs: AttentionNeeds = CAUSAL_ONLY) -> str:
    """The kernel sampling runs for `model.attn_implementation`: a KV cache and left-padded prompts need a mask,
    so sdpa unless a kernel that has one; for soft-capping or sinks, this module's (the prompt blockwise, the steps
    eager); eager for a family transformers does not run under sdpa."""
    if choice in ("eager", "flex_attention", REGISTERED_FLEX) or (choice == "flash_attention_2" and not needs.sinks):
        return choice
    if needs.softcap or needs.sinks:
        return BLOCKWISE_GENERATION
    return "sdpa" if needs.sdpa_exact else "eager"


def prompt_starts(mask: torch.Tensor | None, queries: int, keys: int, rows: int) -> list[int] | None:
    """Each row's first real token where this is a prompt's forward from an empty cache (the queries are the
    cache's first tokens, left-padded), else None (a decoding step, or a forward continuing a cache)."""
    if queries == 1:
        return None
    if mask is None:  # transformers skips the mask for unpadded rows whose causal mask is sdpa's top-left one
        return [0] * rows
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    if keys > queries and bool(allowed[:, -1, queries:].any()):  # the last query sees keys past the prompt
        return None
    real = allowed[:, :, :queries].diagonal(dim1=-2, dim2=-1)  # a real token sees itself, padding is never seen
    starts = (~real).sum(-1).tolist()
    if any(not bool(row[start:].all()) for row, start in zip(real, starts, strict=True)):
        return None  # not left padding
    return starts


def eager_step(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float | None, **kwargs: Any) -> torch.Tensor:
    """The family's own eager attention, given the boolean mask as the additive one it takes."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, mask, dropout=0.0, scaling=scaling, **kwargs)[0]


@torch.compiler.disable
def blockwise_generation_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attention_mask: torch.Tensor | None, scaling: float | None = None,
                                 dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: [batch, heads, tokens, dim] in, [batch, tokens, heads, dim] out."""
    queries = query.shape[2]
    starts = prompt_starts(attention_mask, queries, key.shape[2], query.shape[0])
    if starts is None:
        return eager_step(module, query, key, value, attention_mask, scaling, **kwargs), None
    options = AttentionOptions.from_kwargs(kwargs)
    out = query.new_zeros(query.shape)  # padding's outputs: never a key, never read
    for row, start in enumerate(starts):
        if start < queries:
            out[row : row + 1, :, start:] = family_attention(
                query[row : row + 1, :, start:], key[row : row + 1, :, start:queries],
                value[row : row + 1, :, start:queries], scaling, options)
    return out.transpose(1, 2).contiguous(), None


# registered at import, beside the masks transformers builds for it (sdpa's booleans)
AttentionInterface.register(BLOCKWISE_GENERATION, blockwise_generation_forward)
AttentionMaskInterface.register(BLOCKWISE_GENERATION, sdpa_mask)
