"""Context parallel (`fsdp.context_parallel`): one row split over the ranks of a group, attention across the split.

Each rank holds a contiguous 1/n of every row for all but attention: embeddings, norms, projections, rotary
positions (per token, from the rank's own position ids), the MLP and the loss. Attention needs the whole row, so
it is entered through an all-to-all that trades the rank's tokens of every head for every token of 1/n of the
heads (DeepSpeed Ulysses' layout). The per-sample kernel then runs on the whole row for those heads, windows,
soft-capping and sinks as the family defines them, reading the whole row's sample bounds; a second all-to-all
trades back. Samples may cross the split: attention never sees one. Activations a rank holds are 1/n of the
row's everywhere, attention included; each layer moves its queries, keys, values and output once each way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from transformers import PretrainedConfig

from qlora_fsdp.errors import ModelLoadError

SPLIT_ATTRIBUTE = "row_split"  # set on each attention module; the kernel reads it


@dataclass(frozen=True)
class HeadTrade:
    """The all-to-alls around one attention call, over the ranks sharing a row."""

    group: dist.ProcessGroup
    degree: int
    index: int  # this rank's part of the row, and so its share of the heads

    def _trade(self, parts: torch.Tensor) -> torch.Tensor:
        """parts [degree, ...]: part j goes to rank j; returns [degree, ...], part j from rank j."""
        return all_to_all_single_autograd(parts.contiguous(), None, None, self.group)

    def whole_row(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, heads, local tokens, dim] -> [batch, heads / degree, all tokens, dim] (this rank's heads)."""
        batch, heads, tokens, dim = x.shape
        parts = x.reshape(batch, self.degree, heads // self.degree, tokens, dim).transpose(0, 1)
        traded = self._trade(parts)  # [source rank = part of the row, batch, my heads, local tokens, dim]
        return traded.permute(1, 2, 0, 3, 4).reshape(batch, heads // self.degree, self.degree * tokens, dim)

    def own_part(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, heads / degree, all tokens, dim] -> [batch, heads, local tokens, dim]: whole_row undone."""
        batch, heads, tokens, dim = x.shape
        parts = x.reshape(batch, heads, self.degree, tokens // self.degree, dim).permute(2, 0, 1, 3, 4)
        traded = self._trade(parts)  # [source rank = its heads, batch, heads / degree, local tokens, dim]
        return traded.transpose(0, 1).reshape(batch, heads * self.degree, tokens // self.degree, dim)

    def own_heads(self, per_head: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a per-head parameter (gpt-oss' sinks), in whole_row's head order."""
        return per_head.chunk(self.degree)[self.index]


def mixers(layer: nn.Module) -> list[str]:
    """The token mixers of a decoder layer other than its self-attention (what the split cannot see across)."""
    named = ("linear_attn", "mamba", "conv", "short_conv", "cross_attn", "mixer")
    return [name for name in named if isinstance(getattr(layer, name, None), nn.Module)]


def refuse_unsplittable(config: PretrainedConfig, layers: list[nn.Module], degree: int) -> None:
    """One line for a family the split cannot run: heads that do not divide, or a mixer that is not attention."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % degree or kv_heads % degree:
        raise ModelLoadError(f"{config.model_type}: {heads} attention heads and {kv_heads} key/value heads do not "
                             f"divide over 'fsdp.context_parallel: {degree}' ranks; use a divisor of {kv_heads}")
    for layer in layers:
        other = mixers(layer)
        if other or not isinstance(getattr(layer, "self_attn", None), nn.Module):
            what = other[0] if other else "no self_attn"
            raise ModelLoadError(f"{config.model_type}: a decoder layer mixes tokens by '{what}', which context "
                                 "parallel cannot split (only attention is traded across the ranks); use "
                                 "fsdp.context_parallel: 1")


def split_attention(layers: list[nn.Module], config: PretrainedConfig, trade: HeadTrade) -> None:
    """Every layer's attention runs across the split rows (the kernel finds `trade` on its module)."""
    refuse_unsplittable(config, layers, trade.degree)
    for layer in layers:
        setattr(layer.self_attn, SPLIT_ATTRIBUTE, trade)


def trade_of(module: nn.Module) -> HeadTrade | None:
    found = getattr(module, SPLIT_ATTRIBUTE, None)
    return found if isinstance(found, HeadTrade) else None


def model_trade(model: nn.Module) -> HeadTrade | None:
    """The trade of a model whose rows are split over ranks (None: it takes whole rows)."""
    return next((trade for module in model.modules() if (trade := trade_of(module)) is not None), None)


def own_head_kwargs(trade: HeadTrade, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The attention kwargs with per-head tensors cut to this rank's heads."""
    sinks = kwargs.get("s_aux")
    return kwargs if sinks is None else {**kwargs, "s_aux": trade.own_heads(sinks)}
