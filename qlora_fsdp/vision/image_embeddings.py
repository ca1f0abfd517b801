"""Images into the decoder: a vision-language checkpoint's image side (the vision tower and projector, built by
loading/vision_encoder.py) turns a micro-batch's pixels into features, and the input embeddings at its image tokens
are replaced by them, as the family's own forward does (`masked_scatter` after the token embedding, a scaled one
included), with a forward hook on the embedding for the one forward that needs it. The decoder is training's
sharded one and never sees pixels. What a family adds is handed to the decoder's forward by hooks here: Gemma 3's
both-ways masks, Qwen-VL's grid positions (image_positions.py), Qwen3-VL's deepstack features, and Llama 3.2
Vision's cross-attention inputs (cross_attention_images.py), which replace the embedding path for that family.

The image side is replicated on every rank rather than sharded by FSDP2: it holds no collectives, so ranks whose
micro-batches differ in images (one text-only, one with three images) never wait on each other. Frozen, it is kept
beside the model, not as a submodule; trained, it is registered under the causal LM after sharding
(loading/image_side_training.py), which FSDP2 then leaves alone.
"""

from __future__ import annotations

import copy
import importlib
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from qlora_fsdp.errors import DataError
from qlora_fsdp.layers.attention import sample_bounds
from qlora_fsdp.vision.cross_attention_images import cross_attention_inputs
from qlora_fsdp.vision.image_positions import GridPositions


@dataclass
class VisionEncoder:
    """Pixels -> the decoder's embeddings at the image tokens."""

    base: Any  # the checkpoint's base model without its decoder (LlavaModel, ...: its get_image_features)
    image_token_id: int
    dtype: torch.dtype  # what it computes in (the recipe's 4-bit compute dtype)
    both_ways_masks: str | None = None  # families.ImageFamily's: an image's tokens attend to each other both ways
    grid_positions: bool = False  # families.ImageFamily's: rotary positions over 3 axes, the images' from their grids
    cross_attention: bool = False  # families.ImageFamily's: the text reads the images' states in cross-attention
    max_tiles: int = 1  # Llama 3.2 Vision: the tiles an image's states hold (its own, then masked ones)
    trains: bool = False  # its projector or LoRA on its tower train (loading/image_side_training.py)

    def features(self, vision: dict[str, torch.Tensor], device: torch.device) -> EncodedImages:
        """Every image's features in order, one row an image token: what the family's forward scatters there (and
        Qwen3-VL's deepstack features, one such tensor for each of the first decoder layers). With a gradient
        where the image side trains and the caller computes one."""
        with torch.set_grad_enabled(self.trains and torch.is_grad_enabled()):
            return self.encode(vision, device)

    def encode(self, vision: dict[str, torch.Tensor], device: torch.device) -> EncodedImages:
        inputs = {key: value.to(device) for key, value in vision.items()}
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        if self.cross_attention:
            return EncodedImages(self.cross_attention_states(inputs), None)
        out = self.base.get_image_features(**inputs, return_dict=True)
        deepstack = getattr(out, "deepstack_features", None)
        return EncodedImages(image_rows(out.pooler_output),
                             None if deepstack is None else [image_rows(layer) for layer in deepstack])


    def cross_attention_states(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Llama 3.2 Vision: each image's tiles through the tower and the projector, [images, tiles x patches,
        hidden]: what its cross-attention layers read (the family's forward, all images as one sample)."""
        towered = self.base.vision_model(pixel_values=inputs["pixel_values"][None],
                                         aspect_ratio_ids=inputs["aspect_ratio_ids"][None],
                                         aspect_ratio_mask=inputs["aspect_ratio_mask"][None])
        return cast(torch.Tensor, self.base.multi_modal_projector(towered.last_hidden_state))[0].flatten(1, 2)


@dataclass
class EncodedImages:
    features: torch.Tensor  # [image tokens, hidden]: the embeddings at the image tokens
    deepstack: list[torch.Tensor] | None  # Qwen3-VL: added to the image tokens' outputs of the first layers


def image_rows(pooled: Any) -> torch.Tensor:
    """A family's features (a tensor, or one per image) as one row an image token, in order."""
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


def image_token_of(model: nn.Module) -> int | None:
    """The image token of a model with an image side beside it; None for a text-only one."""
    attached = _ENCODERS.get(model)
    return None if attached is None else attached.image_token_id


@dataclass(frozen=True)
class RowPart:
    """A split row's part (context parallel): the whole row's ids and where the part starts. Every rank of the
    split encodes the row's images and takes what belongs to its own image tokens."""

    row_ids: torch.Tensor  # [tokens of the whole row]
    start: int

    def image_tokens_before(self, image_token_id: int) -> int:
        return int((self.row_ids[: self.start] == image_token_id).sum())


@contextmanager
def images_in_embeddings(model: nn.Module, vision: dict[str, torch.Tensor] | None, device: torch.device,
                         part: RowPart | None = None) -> Iterator[None]:
    """Within the block, the model's forward embeds `vision`'s images at their tokens (nothing without images).
    `part`: the forward holds a split row's part (its image tokens' features, positions and deepstack rows)."""
    attached = _ENCODERS.get(model)
    if attached is not None and attached.cross_attention:  # every micro-batch, with images or not (FSDP's gathers)
        states = attached.features(vision, device).features if vision is not None else None
        tiles = vision["aspect_ratio_mask"].sum(-1).tolist() if vision is not None else []
        with cross_attention_inputs(decoder_model(model), attached.image_token_id, attached.max_tiles, states, tiles):
            yield
        return
    if vision is None:
        yield
        return
    encoder = vision_encoder(model)
    embedding = cast(nn.Module, cast(Any, model).get_input_embeddings())
    encoded = encoder.features(vision, device)
    features = encoded.features

    before = 0 if part is None else part.image_tokens_before(encoder.image_token_id)

    def scatter(_module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        mask = args[0] == encoder.image_token_id
        if not mask.any():  # generation's decoding steps after the prompt: new tokens only
            return output
        here = int(mask.sum())
        if (here + before) * output.shape[-1] > features.numel() or (
                part is None and here * output.shape[-1] != features.numel()):
            raise DataError(f"a micro-batch has {here + before} image tokens for {features.shape[0]} image "
                            "features: its images and their tokens disagree")
        return output.masked_scatter(mask.unsqueeze(-1), features[before : before + here].to(output.dtype))

    handles = [embedding.register_forward_hook(scatter)]
    if encoder.both_ways_masks is not None:
        decoder = decoder_model(model)
        handles.append(decoder.register_forward_pre_hook(partial(image_blocks, encoder), with_kwargs=True))
    if encoder.grid_positions:
        positions = GridPositions(encoder.base, encoder.image_token_id, vision["image_grid_thw"], part)
        handles.append(decoder_model(model).register_forward_pre_hook(positions, with_kwargs=True))
    if encoded.deepstack is not None:
        deepstack = partial(deepstack_inputs, encoder.image_token_id, encoded.deepstack, before)
        handles.append(decoder_model(model).register_forward_pre_hook(deepstack, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def decoder_model(model: nn.Module) -> nn.Module:
    """The decoder's base model (its forward takes the ids, the positions and the attention mask)."""
    causal_lm: Any = cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model
    return cast(nn.Module, getattr(causal_lm, causal_lm.base_model_prefix))


def image_blocks(encoder: VisionEncoder, module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """For a family whose image tokens see each other both ways (Gemma 3): the decoder's masks, built by the
    family's own code from where the images are (causal, or-ed with each image's block; sliding where the layer
    is), handed to the decoder in place of its causal ones. The attention kernels read a given mask. Packed rows
    get each sample's own masks on the diagonal (transformers builds them for one sample a row: the sliding
    layers' overlay is lost for a sample that does not start the row)."""
    ids = kwargs.get("input_ids")
    if ids is None or not bool((ids == encoder.image_token_id).any()):
        return None
    positions, padding = kwargs.get("position_ids"), kwargs.get("attention_mask")
    cache = kwargs.get("past_key_values")
    if isinstance(padding, dict):  # generation's prompt forward with a static cache: masks as wide as the cache
        padding = padding_of(padding, ids)
    if positions is None or padding is not None:  # one sample a row
        return args, {**kwargs, "attention_mask": family_masks(encoder, module, ids, padding, positions, cache)}
    rows = []
    for row in range(ids.shape[0]):
        bounds = sample_bounds(positions[row])
        per_sample = [family_masks(encoder, module, ids[row : row + 1, start:end], None, None)
                      for start, end in bounds]
        rows.append(block_diagonal(per_sample, bounds, ids.shape[1], ids.device))
    masks = {key: torch.cat([row[key] for row in rows]) for key in rows[0]}
    return args, {**kwargs, "attention_mask": masks}


def padding_of(masks: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
    """The [rows, tokens] padding mask behind the masks transformers' generate built for a static cache's prompt
    forward: what a row's last token (a real one: rows are left-padded) may attend to among the prompt's tokens."""
    full = masks.get("full_attention")
    if full is None:
        return torch.ones_like(ids)
    last = full[:, 0, -1, : ids.shape[1]]
    return (last if last.dtype == torch.bool else last == 0).long()


def family_masks(encoder: VisionEncoder, module: nn.Module, ids: torch.Tensor, padding: torch.Tensor | None,
                 positions: torch.Tensor | None, cache: Any = None) -> dict[str, torch.Tensor | None]:
    """transformers' own masks of the family for these rows, as boolean [rows, 1, tokens, keys] (None: plain
    causal); keys: the tokens, or a generation cache's length."""
    family = importlib.import_module(cast(str, encoder.both_ways_masks))
    config = copy.copy(cast(Any, module).config)
    config._attn_implementation = "sdpa"  # boolean masks, which every kernel here reads
    blocks = family.get_block_sequence_ids_for_mask((ids == encoder.image_token_id).long(), device=ids.device)
    return cast(dict[str, torch.Tensor | None], family.create_masks_for_vision_model(
        config=config, inputs_embeds=torch.empty(*ids.shape, 1, dtype=encoder.dtype, device=ids.device),
        attention_mask=padding, past_key_values=cache, position_ids=positions, block_sequence_ids=blocks))


def block_diagonal(per_sample: list[dict[str, torch.Tensor | None]], bounds: list[tuple[int, int]], width: int,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """One packed row's masks: each sample's on the diagonal (plain causal where transformers left it to the
    kernel), nothing across samples."""
    out = {}
    for key in per_sample[0]:
        full = torch.zeros(1, 1, width, width, dtype=torch.bool, device=device)
        for masks, (start, end) in zip(per_sample, bounds, strict=True):
            mask = masks[key]
            causal = torch.ones(end - start, end - start, dtype=torch.bool, device=device).tril()
            full[0, 0, start:end, start:end] = causal if mask is None else mask[0, 0]
        out[key] = full
    return out


def deepstack_inputs(image_token_id: int, deepstack: list[torch.Tensor], before: int, module: nn.Module,
                     args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Qwen3-VL's decoder adds the vision tower's intermediate features to the image tokens' hidden states after
    its first layers: handed to its forward where the image tokens are (none in a decoding step; a split row's
    part: the rows of its own image tokens, after the `before` of the parts before it)."""
    ids = kwargs.get("input_ids")
    if ids is None or not bool((ids == image_token_id).any()):
        return None
    mask = ids == image_token_id
    here = int(mask.sum())
    return args, {**kwargs, "visual_pos_masks": mask,
                  "deepstack_visual_embeds": [layer[before : before + here] for layer in deepstack]}
