"""Images into the decoder: a vision-language checkpoint's image side (the vision tower and projector, built by
loading/vision_encoder.py) turns a micro-batch's pixels into features, and the input embeddings at its image tokens
are replaced by them, as the family's own forward does (`masked_scatter` after the token embedding, a scaled one
included), with a forward hook on the embedding for the one forward that needs it. The decoder is training's
sharded one and never sees pixels.

The image side is frozen and replicated on every rank rather than sharded by FSDP2: it holds no collectives, so
ranks whose micro-batches differ in images (one text-only, one with three images) never wait on each other. It is
kept beside the model, not as a submodule, so FSDP2 never wraps it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from qlora_fsdp.errors import DataError


@dataclass
class VisionEncoder:
    """Pixels -> the decoder's embeddings at the image tokens."""

    base: Any  # the checkpoint's base model without its decoder (LlavaModel, ...: its get_image_features)
    image_token_id: int
    dtype: torch.dtype  # what it computes in (the recipe's 4-bit compute dtype)

    @torch.no_grad()
    def features(self, vision: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        """Every image's features in order, one row an image token: what the family's forward scatters there."""
        inputs = {key: value.to(device) for key, value in vision.items()}
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        out = self.base.get_image_features(**inputs, return_dict=True)
        pooled = out.pooler_output
        return torch.cat(list(pooled), dim=0) if isinstance(pooled, list | tuple) else pooled.flatten(0, -2)


_ENCODERS: weakref.WeakKeyDictionary[nn.Module, VisionEncoder] = weakref.WeakKeyDictionary()


def attach_vision_encoder(model: nn.Module, encoder: VisionEncoder) -> None:
    """Keep the encoder beside the model (outside FSDP2's reach: not a submodule)."""
    _ENCODERS[model] = encoder


def vision_encoder(model: nn.Module) -> VisionEncoder:
    found = _ENCODERS.get(model)
    if found is None:
        raise DataError("a micro-batch holds images but the model has no vision encoder (a vision-language "
                        "checkpoint's data is loaded with its images before the model is built)")
    return found


@contextmanager
def images_in_embeddings(model: nn.Module, vision: dict[str, torch.Tensor] | None,
                         device: torch.device) -> Iterator[None]:
    """Within the block, the model's forward embeds `vision`'s images at their tokens (nothing without images)."""
    if vision is None:
        yield
        return
    encoder = vision_encoder(model)
    embedding = cast(nn.Module, cast(Any, model).get_input_embeddings())
    features = encoder.features(vision, device)

    def scatter(_module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        mask = args[0] == encoder.image_token_id
        if not mask.any():  # generation's decoding steps after the prompt: new tokens only
            return output
        if int(mask.sum()) * output.shape[-1] != features.numel():
            raise DataError(f"a micro-batch has {int(mask.sum())} image tokens for {features.shape[0]} image "
                            "features: its images and their tokens disagree")
        return output.masked_scatter(mask.unsqueeze(-1), features.to(output.dtype))

    handle = embedding.register_forward_hook(scatter)
    try:
        yield
    finally:
        handle.remove()
