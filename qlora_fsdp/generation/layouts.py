"""Where the policy's weights are while it generates: a layout entered once per generation call and left once.

- `per_token`: as training holds them. Every decoding step gathers each layer again (FSDP2's forward), so ranks
  step together (HF's `synced_gpus`) and the link carries the whole model every token.
- `gathered`: every rank gathers the whole model once (FSDP2's unshard of every module, kept until the call
  ends), generates its own rows on its own, and frees the gathered weights after. The link carries the model once
  a call; ranks do not wait for each other. Needs room for the whole 4-bit decoder beside the KV cache.
- `split`: each rank holds whole its contiguous share of the decoder layers for the call (gathered once; the
  shares of the others freed at once). The rows of every rank pass through the layers' owners: at a layer, each
  rank sends its hidden states to the owner, which runs the layer on every rank's rows together and sends each
  rank its part back. Only hidden states cross the link per token, and a rank holds 1/world of the layers. The
  root (embeddings, final norm, head) is gathered on every rank, as in `gathered`.

With CPU offload (FSDP2's CPUOffloadPolicy), unsharding copies the host shards to the GPU, so `gathered` and
`split` copy them once a call, not once a token.

Why `split` runs every rank's rows through a layer at once rather than as a pipeline of micro-batches: decoding is
bound by reading (dequantizing) the weights, which costs the same for one row or all; a pipeline would keep both
cards busy, but each would read its layers once per micro-batch, so a token costs the same time either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from qlora_fsdp.generation.plan import GenerationPlan, Layout, chosen_layout
from qlora_fsdp.generation.room import fits_now, gathered_extra_bytes, unsharded_extra
from qlora_fsdp.layers.checkpointing import layer_slots
from qlora_fsdp.torch_versions import fsdp_param_groups

LAYOUTS: tuple[Layout, ...] = ("per_token", "gathered", "split")


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshards_after_forward(module: FSDPModule) -> bool:
    """The module's reshard_after_forward, read back (FSDP2 keeps it as the mesh it reshards to)."""
    groups = fsdp_param_groups(module._get_fsdp_state())
    return any(group.post_forward_mesh_info is not None for group in groups)


@contextmanager
def kept_unsharded(modules: list[FSDPModule]) -> Iterator[None]:
    """The modules' forwards find their weights gathered and leave them so; on exit they are freed and the
    modules reshard after forward as they did before."""
    before = [reshards_after_forward(m) for m in modules]
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module, reshard in zip(modules, before, strict=True):
            module.reshard()
            module.set_reshard_after_forward(reshard, recurse=False)


@contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Every FSDP module's weights gathered once for the call (a collective: every rank enters together)."""
    modules = fsdp_modules(model)
    with kept_unsharded(modules):
        for module in modules:
            module.unshard()
        yield


def layer_owner(index: int, layers: int, world_size: int) -> int:
    """Contiguous shares: rank r owns layers [r * L / W, (r + 1) * L / W)."""
    return index * world_size // layers


PER_ROW_ARGUMENTS = ("attention_mask", "position_ids", "position_embeddings")  # a decoder layer's, by name


class RelayedLayer(nn.Module):
    """A decoder layer in the `split` layout: every rank's rows go to the layer's owner, which runs them together
    and hands each rank its part. On the other ranks the layer's cache slot only counts the tokens (zero-width
    keys and values), so the model's masks see the length they would."""

    def __init__(self, layer: nn.Module | None, index: int, owner: int, group: Any = None) -> None:
        super().__init__()
        self.layer = layer  # the owner's whole layer (its FSDP module, kept gathered); None elsewhere
        self.index, self.owner, self.group = index, owner, group

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        rank = dist.get_rank(self.group)
        per_row: dict[str, Any] = {key: kwargs[key] for key in PER_ROW_ARGUMENTS if key in kwargs}
        per_row |= {f"#{index}": value for index, value in enumerate(args)}  # Gemma 4's per-layer input, by position
        rows = hidden_states.shape[0]
        flat = flat_tensors(hidden_states, per_row)
        # a tensor of one row a batch row comes from every rank; others (shared positions) are the same on all
        gathered = [gather_to(t, self.owner, self.group) if t.shape[:1] == (rows,) else None for t in flat]
        if rank != self.owner:
            count_cached_tokens(kwargs.get("past_key_values"), self.index, hidden_states)
            out = torch.empty_like(hidden_states)
            dist.scatter(out, None, src=self.owner, group=self.group)
            return out
        assert self.layer is not None
        joined = iter([torch.cat(parts) if parts is not None else t for parts, t in zip(gathered, flat, strict=True)])
        hidden = next(joined)
        rebuilt: dict[str, Any] = {key: rebuild(value, joined) for key, value in per_row.items()}
        positional = [rebuilt.pop(f"#{index}") for index in range(len(args))]
        result = self.layer(hidden, *positional, **{**kwargs, **rebuilt})
        output = result[0] if isinstance(result, tuple) else result
        parts = [part.contiguous() for part in output.split(rows)]
        mine = torch.empty_like(parts[rank])
        dist.scatter(mine, parts, src=self.owner, group=self.group)
        return (mine, *result[1:]) if isinstance(result, tuple) else mine


def flat_tensors(hidden: torch.Tensor, per_row: dict[str, Any]) -> list[torch.Tensor]:
    """The hidden states, then every tensor of the per-row arguments in order (tuples of cos and sin flattened)."""
    out = [hidden]
    for value in per_row.values():
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, tuple):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
        elif value is not None:
            raise TypeError(f"a layer argument the split layout cannot pass between ranks: {type(value).__name__}")
    return out


def rebuild(value: Any, joined: Iterator[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return next(joined)
    if isinstance(value, tuple):
        return tuple(next(joined) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def gather_to(tensor: torch.Tensor, owner: int, group: Any) -> list[torch.Tensor] | None:
    """Every rank's tensor (the same shape on all) on the owner, in rank order; None elsewhere. gloo has neither bool
    nor complex collectives: bools travel as bytes, complex numbers (Llama 4's rotary) as their real pairs."""
    is_bool, is_complex = tensor.dtype == torch.bool, tensor.is_complex()
    sent = (tensor.to(torch.uint8) if is_bool else torch.view_as_real(tensor) if is_complex else tensor).contiguous()
    rank = dist.get_rank(group)
    parts = [torch.empty_like(sent) for _ in range(dist.get_world_size(group))] if rank == owner else None
    dist.gather(sent, parts, dst=owner, group=group)
    if parts is None or not (is_bool or is_complex):
        return parts
    return [part.bool() if is_bool else torch.view_as_complex(part) for part in parts]


def count_cached_tokens(cache: Any, index: int, hidden: torch.Tensor) -> None:
    """A layer another rank runs still advances this rank's cache slot, by zero-width keys and values."""
    layers = getattr(cache, "layers", None)
    if layers is None or index >= len(layers) or not hasattr(layers[index], "update"):
        return
    empty = hidden.new_zeros(hidden.shape[0], 1, hidden.shape[1], 0)
    layers[index].update(empty, empty)


@contextmanager
def split_by_layers(model: nn.Module, group: Any = None) -> Iterator[None]:
    """Each rank holds its share of the decoder layers whole for the call, and the root gathered."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if isinstance(model, FSDPModule):
        # FSDP2 learns its module tree at the first forward: taken inside this layout (a step that generates
        # first), each rank would see only its own layers, and later backwards would prefetch differently per
        # rank and hang (found by a backward after a split generation at world size 2)
        model._get_fsdp_state()._lazy_init()
    slots = layer_slots(model)
    owned = [m for i, (parent, name) in enumerate(slots)
             if layer_owner(i, len(slots), world) == rank and isinstance(m := getattr(parent, name), FSDPModule)]
    root = [m for m in fsdp_modules(model) if all(m is not getattr(p, n) for p, n in slots)]
    originals = [getattr(parent, name) for parent, name in slots]
    with kept_unsharded([*owned, *root]):
        for index, module in enumerate(originals):  # each layer gathered once: kept by its owner only
            if isinstance(module, FSDPModule):
                module.unshard()
                if layer_owner(index, len(slots), world) != rank:
                    module.reshard()
        for module in root:
            module.unshard()
        for index, (parent, name) in enumerate(slots):
            owner = layer_owner(index, len(slots), world)
            setattr(parent, name, RelayedLayer(originals[index] if owner == rank else None, index, owner, group))
        try:
            yield
        finally:
            for (parent, name), module in zip(slots, originals, strict=True):
                setattr(parent, name, module)


@contextmanager
def generation_layout(model: nn.Module, layout: Layout) -> Iterator[None]:
    """Enter `layout` for one generation call (every rank together); a model without FSDP has one layout."""
    if layout == "per_token" or not fsdp_modules(model) or not dist.is_initialized():
        yield
    elif layout == "gathered":
        with gathered(model):
            yield
    else:
        with split_by_layers(model):
            yield


def graphs_for(setting: str, on_gpu: bool, layout: Layout, images: bool = False) -> bool:
    """Whether the decoding step is replayed as a CUDA graph (`generation.graphs`; auto: on a GPU): for the
    gathered layout only, since split and per_token run collectives inside the step; not for a policy that sees
    images (its decoding steps' positions come from a hook that holds each row's offset in Python: a graph would
    replay the first call's)."""
    return layout == "gathered" and not images and (setting == "on" or (setting == "auto" and on_gpu))


def steps_together(layout: Layout, world_size: int) -> bool:
    """Whether ranks must run the same number of forwards (a collective inside every forward)."""
    return world_size > 1 and layout != "gathered"


def resolved_layout(model: nn.Module, plan: GenerationPlan, rows: int, prompt_tokens: int,
                    device: torch.device) -> Layout:
    """The plan's layout rule (generation/plan.py) over this GPU's free memory now, for calls of `rows` rows of
    `prompt_tokens` prompt tokens."""
    world = dist.get_world_size() if fsdp_modules(model) and dist.is_initialized() else 1
    tokens = prompt_tokens + plan.new_tokens
    rank = dist.get_rank() if world > 1 else 0
    return chosen_layout(plan.settings.layout, world,
                         lambda: fits_now(model, gathered_extra_bytes(model), rows, tokens, device),
                         lambda: fits_now(model, split_extra_bytes(model, rank, world), rows, tokens, device))


def split_extra_bytes(model: nn.Module, rank: int, world: int) -> int:
    """Bytes the split layout adds to this rank's shards: its share of the decoder layers and the root, whole."""
    slots = layer_slots(model)
    others = {id(param) for index, (parent, name) in enumerate(slots) if layer_owner(index, len(slots), world) != rank
              for param in getattr(parent, name).parameters()}
    return sum(unsharded_extra(param) for param in model.parameters() if id(param) not in others)
