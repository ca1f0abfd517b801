"""Activation checkpointing: which decoder layers, and what inside them, backward recomputes.

Applied before `fully_shard` (sharding.py), non-reentrant (FSDP2 leaks memory with the reentrant variant), so
FSDP's gather hooks sit outside every recomputed region. The one policy object is the recipe's
`activation_checkpointing` section; training runs it and the planner measures the very same wrapping.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from qlora_fsdp.config import ActivationCheckpointingConfig
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.layers.decoder import decoder_layers

SUB_LAYERS = {"attention": "self_attn", "mlp": "mlp"}  # the attribute names of every supported family

# scope `ops` keeps these outputs (the matmuls and attention: the costly ops) and recomputes the rest (norms,
# rotary, activations, casts, the 4-bit dequantization, whose output is a whole weight and cheap to redo)
aten = torch.ops.aten
SAVED_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
})


def save_matmul_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing's choice per operator: keep what is costly to recompute."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(module: nn.Module, selective: bool = False) -> nn.Module:
    extra = {"context_fn": partial(create_selective_checkpoint_contexts, save_matmul_outputs)} if selective else {}
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra)


def layer_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every decoder layer, or of its checkpoint wrapper once wrapped."""
    layer_ids = {id(layer) for layer in decoder_layers(model)}
    slots = []
    for parent in model.modules():
        if isinstance(parent, CheckpointWrapper):
            continue
        for name, child in parent.named_children():
            inner = child._checkpoint_wrapped_module if isinstance(child, CheckpointWrapper) else child
            if id(inner) in layer_ids:
                slots.append((parent, name))
    return slots


def checkpoint_sub_layer(layer: nn.Module, scope: str) -> None:
    attribute = SUB_LAYERS[scope]
    sub_layer = getattr(layer, attribute, None)
    if not isinstance(sub_layer, nn.Module):
        raise ConfigError(f"'activation_checkpointing.scope: {scope}' needs a `{attribute}` sub-layer, which "
                          f"{type(layer).__name__} lacks; use scope layer or ops")
    layer.register_module(attribute, checkpointed(sub_layer))


def apply_activation_checkpointing(model: nn.Module, policy: ActivationCheckpointingConfig) -> int:
    """Wrap what the policy chooses in each chosen layer; returns how many layers were wrapped."""
    slots = layer_slots(model)
    if policy.mode == "layers" and max(policy.layers, default=0) >= len(slots):
        raise ConfigError(f"'activation_checkpointing.layers' names layer {max(policy.layers)}, but the model has "
                          f"{len(slots)} (0 to {len(slots) - 1})")
    wrapped = 0
    for index, (parent, name) in enumerate(slots):
        if not policy.wraps(index, len(slots)):
            continue
        layer = getattr(parent, name)
        if policy.scope in SUB_LAYERS:
            checkpoint_sub_layer(layer, policy.scope)
        else:
            parent.register_module(name, checkpointed(layer, selective=policy.scope == "ops"))
        wrapped += 1
    return wrapped
