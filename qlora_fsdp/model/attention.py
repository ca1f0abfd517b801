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
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from qlora_fsdp.config.schema import AttnImplementation
from qlora_fsdp.errors import ConfigError

VARLEN_SDPA = "sdpa_varlen"


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


def causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Causal attention of [batch, heads, tokens, dim] tensors; grouped queries share key/value heads without
    copies (5-10% faster than repeating them on CPU, bf16, 150-1,024 tokens)."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                          enable_gqa=query.shape[1] != key.shape[1])


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
    """transformers' attention-function interface: [batch, heads, tokens, dim] in, [batch, tokens, heads, dim] out."""
    if query.shape[2] != key.shape[2]:
        raise RuntimeError(f"{VARLEN_SDPA} is for training and evaluation (no KV cache); generate with sdpa")
    if dropout:
        raise RuntimeError(f"{VARLEN_SDPA} has no attention dropout; use sdpa or eager")
    position_ids = kwargs.get("position_ids")
    if position_ids is None or position_ids.shape[0] != query.shape[0]:  # one sample a row (padded, or alone)
        return causal_sdpa(query, key, value, scaling).transpose(1, 2).contiguous(), None
    bounds = getattr(position_ids, "sample_bounds", None) or [sample_bounds(row) for row in position_ids]
    rows = []
    for row, row_bounds in enumerate(bounds):
        parts = [causal_sdpa(query[row : row + 1, :, start:end], key[row : row + 1, :, start:end],
                             value[row : row + 1, :, start:end], scaling)
                 for start, end in row_bounds]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


# registered once, at import: transformers looks the name up in every attention layer's forward. It is
# deliberately not registered as a mask function, so transformers builds no mask for it.
AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_forward)


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(choice: str, packing: bool, device_type: str) -> str:
    """The kernel a run uses for `model.attn_implementation` (`auto`: exact and the fastest measured)."""
    if choice == "auto":
        if not packing:
            return "sdpa"
        return "flash_attention_2" if device_type == "cuda" and flash_attn_installed() else VARLEN_SDPA
    if choice == "flex_attention" and device_type == "cpu":
        raise ConfigError("'model.attn_implementation: flex_attention' cannot train on CPU (torch has no flex "
                          "attention backward there); use auto (per-sample sdpa_varlen)")
    if choice == "flash_attention_2" and not flash_attn_installed():
        raise ConfigError("'model.attn_implementation: flash_attention_2' needs the flash-attn package "
                          "(pip install flash-attn); or use auto")
    return choice


def generation_attention(choice: AttnImplementation) -> AttnImplementation:
    """Sampling runs a KV cache and left-padded prompts, which need a mask: sdpa unless a kernel that has one."""
    return choice if choice in ("eager", "flash_attention_2", "flex_attention") else "sdpa"


def flattens_packed_rows(kernel: str) -> bool:
    """Kernels that read sample boundaries from the position ids of a single row only."""
    return kernel in ("flash_attention_2", VARLEN_SDPA)
