"""Which attention kernel the model runs, and per-sample attention for packed rows.

A packed row holds several samples whose position ids restart at 0. Given only those position ids,
transformers' `sdpa` and `eager` build a dense block-diagonal mask: every token of the row is scored
against every other, so attention costs the full row squared whatever the samples' lengths, and the mask
itself is rows x length^2. `sdpa_varlen` (ours) runs causal scaled-dot-product attention on each sample
on its own: the cost is the sum of the samples' squares, no mask is built, and the fused causal kernel is
used. `flash_attention_2` does the same in one variable-length kernel; transformers only reads the sample
boundaries from position ids in a single row, so packed micro-batches are fed to both as one long row
(`flattens_packed_rows`).

Right-padded rows need no mask under causal attention: a real token only sees the tokens before it, which
are real, and padding is never a target. So `sdpa_varlen` is exact for padded rows too (evaluation).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from qlora_fsdp.errors import ConfigError
from qlora_fsdp.families import CAUSAL_ONLY, AttentionNeeds
from qlora_fsdp.layers.blockwise_attention import blockwise_attention
from qlora_fsdp.layers.flex_attention import REGISTERED_FLEX
from qlora_fsdp.layers.split_rows import own_head_kwargs, trade_of

VARLEN_SDPA = "sdpa_varlen"
# the name transformers knows it by: one containing "sdpa" would make transformers refuse it for the families it
# refuses sdpa for (Gemma 2, gpt-oss), whose soft-capping and sinks this kernel computes
REGISTERED_NAME = "per_sample_attention"


def sample_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each sample in one row: a new sample starts wherever the position does not go up by 1."""
    starts = torch.nonzero(position_ids[1:] != position_ids[:-1] + 1).flatten().add(1).tolist()
    edges = [0, *starts, position_ids.numel()]
    return list(zip(edges[:-1], edges[1:], strict=False))


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The dense block-diagonal causal mask [rows, 1, tokens, tokens] that per-sample attention avoids (what
    transformers builds for sdpa and eager): the reference the benchmark and the GPU check time it against."""
    restarts = torch.ones_like(position_ids, dtype=torch.bool)
    restarts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    sample = torch.cumsum(restarts.long(), dim=1)
    n = position_ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=position_ids.device).tril()
    return ((sample[:, :, None] == sample[:, None, :]) & causal)[:, None]


def causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of [batch, heads, tokens, dim] tensors; grouped queries share key/value heads without
    copies (5-10% faster than repeating them on CPU, bf16, 150-1,024 tokens). `dropout`: on the attention
    probabilities, as transformers' sdpa applies the family's attention_dropout in training."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, dropout_p=dropout,
                                          enable_gqa=query.shape[1] != key.shape[1])


@dataclass(frozen=True)
class AttentionOptions:
    """What a family's attention layer adds to plain causal attention (the kwargs transformers passes it)."""

    window: int | None = None  # a query sees itself and the window-1 tokens before it (transformers' definition)
    softcap: float | None = None  # Gemma 2: scores become softcap * tanh(scores / softcap) before the softmax
    sinks: torch.Tensor | None = None  # gpt-oss: one learned logit a head that takes softmax mass and gives no value
    dropout: float = 0.0  # transformers passes the family's attention_dropout in training, 0 in evaluation
    chunk: int | None = None  # Llama 4's chunked layers: the sample cut into chunks of this many, each on its own

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], dropout: float = 0.0, chunk: int | None = None) -> AttentionOptions:
        return cls(kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux"), dropout, chunk)

    def plain(self, n_tokens: int) -> bool:
        """Nothing but a causal mask for a sample of n_tokens: the fused kernel applies."""
        return self.softcap is None and self.sinks is None and (self.window is None or n_tokens <= self.window)


def family_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                     options: AttentionOptions) -> torch.Tensor:
    """Causal attention of one sample (or rows of one length) as the family defines it, [batch, heads, tokens, dim].
    Plain causal attention goes to the fused kernel; windows, soft-capping and sinks to the blockwise one, which
    never holds more than a block of scores (the softmax in fp32, as transformers' eager attention has it). In a
    chunked layer a query sees the tokens of its chunk only (chunks counted from the sample's start), so each chunk
    is a sample of its own."""
    if options.chunk is not None and query.shape[2] > options.chunk:
        within = replace(options, chunk=None)
        return torch.cat([family_attention(query[:, :, start : start + options.chunk],
                                           key[:, :, start : start + options.chunk],
                                           value[:, :, start : start + options.chunk], scaling, within)
                          for start in range(0, query.shape[2], options.chunk)], dim=2)
    if options.plain(query.shape[2]):
        return causal_sdpa(query, key, value, scaling, options.dropout)
    if options.dropout:  # refused at load (resolve_attention): the blockwise kernel has no dropout
        raise RuntimeError(f"{VARLEN_SDPA} applies attention dropout to plain causal attention only")
    return blockwise_attention(query, key, value, scaling, options.window, options.softcap, options.sinks)


def attach_sample_bounds(position_ids: torch.Tensor, bounds: list[list[tuple[int, int]]]) -> None:
    """Give the position ids the model will see each row's sample bounds, known from the batch's lengths. The
    attention then reads no tensor (no device-to-host copy per layer), so it also runs on the planner's fake
    tensors, which have no values to read."""
    position_ids.sample_bounds = bounds  # type: ignore[attr-defined]


# compiled layers break the graph here and call this eagerly: the bounds differ every step, and a traced call
# would specialize on them and recompile
@torch.compiler.disable
def varlen_sdpa_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: [batch, heads, tokens, dim] in, [batch, tokens, heads, dim] out.
    Under context parallel (a HeadTrade on the module), the row's parts are traded for heads around it."""
    trade = trade_of(module)
    chunk = attention_chunk(module)
    if trade is None:
        return per_sample_attention(query, key, value, attention_mask, scaling, dropout, chunk, **kwargs), None
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and not (kwargs.get("sample_bounds") or hasattr(position_ids, "sample_bounds")):
        raise RuntimeError("context parallel attention needs the whole row's sample bounds on the position ids "
                           "(its own part's positions cannot tell where the other parts' samples start)")
    out = per_sample_attention(trade.whole_row(query), trade.whole_row(key), trade.whole_row(value), attention_mask,
                               scaling, dropout, chunk, **own_head_kwargs(trade, kwargs))
    return trade.own_part(out.transpose(1, 2)).transpose(1, 2).contiguous(), None


def attention_chunk(module: nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (Llama 4's `layer_types` and `attention_chunk_size`), else None."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    layer_types = getattr(config, "layer_types", None)
    if config is None or index is None or not layer_types or layer_types[index] != "chunked_attention":
        return None
    return int(config.attention_chunk_size)


def per_sample_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None, dropout: float,
                         chunk: int | None = None, **kwargs: Any) -> torch.Tensor:
    """Each sample's attention on its own (the bounds from the position ids), [batch, tokens, heads, dim] out."""
    options = AttentionOptions.from_kwargs(kwargs, dropout, chunk)
    if isinstance(attention_mask, torch.Tensor):  # a mask made for the batch (images seen both ways, or the
        if options.softcap is not None or options.sinks is not None or chunk:  # image states ...): dense
            raise RuntimeError(f"{VARLEN_SDPA} reads a given mask only for plain attention")
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             dropout_p=dropout, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous()
    if query.shape[2] != key.shape[2]:
        raise RuntimeError(f"{VARLEN_SDPA} is for training and evaluation (no KV cache); generate with sdpa")
    position_ids = kwargs.get("position_ids")
    if position_ids is None or position_ids.shape[0] != query.shape[0]:  # one sample a row (padded, or alone)
        return family_attention(query, key, value, scaling, options).transpose(1, 2).contiguous()
    bounds = (kwargs.get("sample_bounds") or getattr(position_ids, "sample_bounds", None)
              or [sample_bounds(row) for row in position_ids])
    rows = []
    for row, row_bounds in enumerate(bounds):
        parts = [family_attention(query[row : row + 1, :, start:end], key[row : row + 1, :, start:end],
                                  value[row : row + 1, :, start:end], scaling, options)
                 for start, end in row_bounds]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous()


# registered once, at import: transformers looks the name up in every attention layer's forward. It is
# deliberately not registered as a mask function, so transformers builds no mask for it.
AttentionInterface.register(REGISTERED_NAME, varlen_sdpa_forward)
# also by our name, for code that hands it to transformers itself (families transformers runs sdpa for)
AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_forward)


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(choice: str, packing: bool, device_type: str, needs: AttentionNeeds = CAUSAL_ONLY) -> str:
    """The kernel a run uses for `model.attn_implementation` (`auto`: exact for the family and the fastest measured;
    ours computes windows, soft-capping and sinks, packed or not)."""
    if choice == "auto":
        if not packing:
            return "sdpa" if needs.sdpa_exact else refuse_blockwise_dropout(VARLEN_SDPA, needs)
        flash = device_type == "cuda" and flash_attn_installed() and not (needs.sinks or needs.chunked)
        return "flash_attention_2" if flash else refuse_blockwise_dropout(VARLEN_SDPA, needs)
    if choice == "sdpa" and not needs.sdpa_exact:
        raise ConfigError(f"'model.attn_implementation: sdpa' cannot compute {needs.family}'s attention "
                          f"({'attention sinks' if needs.sinks else 'logit soft-capping'}); use auto")
    if needs.chunked and (choice in ("flash_attention_2", "flex_attention") or packing and choice != VARLEN_SDPA):
        raise ConfigError(f"'model.attn_implementation: {choice}' does not keep {needs.family}'s chunked-attention "
                          f"layers to their chunks{' in packed rows' if packing else ''}; use auto")
    if choice == "flash_attention_2" and needs.sinks:
        raise ConfigError(f"'model.attn_implementation: flash_attention_2' has no attention sinks, which "
                          f"{needs.family} needs; use auto")
    if choice == "flex_attention" and device_type == "cpu":
        raise ConfigError("'model.attn_implementation: flex_attention' cannot train on CPU (torch has no flex "
                          "attention backward there); use auto (per-sample sdpa_varlen)")
    if choice == "flash_attention_2" and not flash_attn_installed():
        raise ConfigError("'model.attn_implementation: flash_attention_2' needs the flash-attn package "
                          "(pip install flash-attn); or use auto")
    return refuse_blockwise_dropout(choice, needs)


def refuse_row_position_scaling(needs: AttentionNeeds, several_samples_a_row: bool, context_length: int) -> None:
    """A sample later in a packed row would have its queries scaled by its place in the row, not in the sample."""
    start = needs.row_position_scaling_from
    if several_samples_a_row and start is not None and context_length > start:
        raise ConfigError(f"{needs.family} scales the queries of its layers without rotary by their position in the "
                          f"row from token {start} on, so rows of {context_length} tokens cannot hold several "
                          f"samples: set data.context_length to {start} or less, or data.packing: false")


def refuse_blockwise_dropout(kernel: str, needs: AttentionNeeds) -> str:
    """Our kernel applies attention dropout where attention is plain causal (Seed-OSS), as sdpa does; windows,
    soft-capping and sinks go to the blockwise kernel, which has none: refused before a weight is read."""
    if kernel == VARLEN_SDPA and needs.dropout and (needs.windowed or needs.softcap or needs.sinks):
        raise ConfigError(f"{needs.family}'s config.json sets attention_dropout {needs.dropout:g}, which {VARLEN_SDPA} "
                          "applies to plain causal attention only (this family has windows, soft-capping or "
                          "sinks): set attention_dropout to 0 in config.json")
    return kernel


def transformers_name(kernel: str) -> str:
    """The attn_implementation to hand transformers for a kernel of ours (flex: with short rows compiling and a
    fallback if compiling fails, layers/flex_attention.py)."""
    return {VARLEN_SDPA: REGISTERED_NAME, "flex_attention": REGISTERED_FLEX}.get(kernel, kernel)


def flattens_packed_rows(kernel: str) -> bool:
    """Kernels that read sample boundaries from the position ids of a single row only (by our name or
    transformers')."""
    return kernel in ("flash_attention_2", VARLEN_SDPA, REGISTERED_NAME)
