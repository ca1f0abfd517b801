"""Images into the decoder: the input embeddings at a micro-batch's image tokens are replaced by the vision
encoder's features for its images, as the family's own forward does (`masked_scatter` after the token embedding,
a scaled one included), with a forward hook on the embedding for the one forward that needs it. The decoder is
training's sharded one and never sees pixels; the features carry no gradient (the image side is frozen)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from qlora_fsdp.errors import DataError
from qlora_fsdp.vision.encoder import vision_encoder


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
        if int(mask.sum()) * output.shape[-1] != features.numel():
            raise DataError(f"a micro-batch has {int(mask.sum())} image tokens for {features.shape[0]} image "
                            "features: its images and their tokens disagree")
        return output.masked_scatter(mask.unsqueeze(-1), features.to(output.dtype))

    handle = embedding.register_forward_hook(scatter)
    try:
        yield
    finally:
        handle.remove()
