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


@contextmanager
def images_in_embeddings(model: nn.Module, vision: dict[str, torch.Tensor] | None,
                         device: torch.device) -> Iterator[None]:
    """Within the block, the model's forward embeds `vision`'s images at their tokens (nothing without images)."""
    attached = _ENCODERS.get(model)
    if attached is not None and attached.cross_attention:  # every micro-batch, with images or not (FSDP's gathers)
        with cross_attention_inputs(model, attached, vision, device):
            yield
        return
    if vision is None:
        yield
        return
    encoder = vision_encoder(model)
    embedding = cast(nn.Module, cast(Any, model).get_input_embeddings())
    encoded = encoder.features(vision, device)
    features = encoded.features

    def scatter(_module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        mask = args[0] == encoder.image_token_id
        if not mask.any():  # generation's decoding steps after the prompt: new tokens only
            return output
        if int(mask.sum()) * output.shape[-1] != features.numel():
            raise DataError(f"a micro-batch has {int(mask.sum())} image tokens for {features.shape[0]} image "
                            "features: its images and their tokens disagree")
        return output.masked_scatter(mask.unsqueeze(-1), features.to(output.dtype))

    handles = [embedding.register_forward_hook(scatter)]
    if encoder.both_ways_masks is not None:
        decoder = decoder_model(model)
        handles.append(decoder.register_forward_pre_hook(partial(image_blocks, encoder), with_kwargs=True))
    if encoder.grid_positions:
        positions = GridPositions(encoder, vision["image_grid_thw"])
        handles.append(decoder_model(model).register_forward_pre_hook(positions, with_kwargs=True))
    if encoded.deepstack is not None:
        deepstack = partial(deepstack_inputs, encoder.image_token_id, encoded.deepstack)
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
    if positions is None or padding is not None:  # one sample a row
        return args, {**kwargs, "attention_mask": family_masks(encoder, module, ids, padding, positions)}
    rows = []
    for row in range(ids.shape[0]):
        bounds = sample_bounds(positions[row])
        per_sample = [family_masks(encoder, module, ids[row : row + 1, start:end], None, None)
                      for start, end in bounds]
        rows.append(block_diagonal(per_sample, bounds, ids.shape[1], ids.device))
    masks = {key: torch.cat([row[key] for row in rows]) for key in rows[0]}
    return args, {**kwargs, "attention_mask": masks}


def family_masks(encoder: VisionEncoder, module: nn.Module, ids: torch.Tensor, padding: torch.Tensor | None,
                 positions: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """transformers' own masks of the family for these rows, as boolean [rows, 1, tokens, tokens] (None: plain
    causal)."""
    family = importlib.import_module(cast(str, encoder.both_ways_masks))
    config = copy.copy(cast(Any, module).config)
    config._attn_implementation = "sdpa"  # boolean masks, which every kernel here reads
    blocks = family.get_block_sequence_ids_for_mask((ids == encoder.image_token_id).long(), device=ids.device)
    return cast(dict[str, torch.Tensor | None], family.create_masks_for_vision_model(
        config=config, inputs_embeds=torch.empty(*ids.shape, 1, dtype=encoder.dtype, device=ids.device),
        attention_mask=padding, past_key_values=None, position_ids=positions, block_sequence_ids=blocks))


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


class GridPositions:
    """For a family with rotary positions over three axes (Qwen-VL): the decoder's image tokens get the positions
    of their place in the image's grid, computed by the family's own `get_rope_index` one sample at a time (packed
    rows keep each sample's own), and the text after an image goes on from there. Generation's new tokens go on
    from the prompt's last position, as the family's `generate` does."""

    def __init__(self, encoder: VisionEncoder, grids: torch.Tensor) -> None:
        self.encoder, self.grids = encoder, grids
        self.deltas: torch.Tensor | None = None  # per row: the last position minus the tokens, after a prompt

    def __call__(self, module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        if ids is None:
            return None
        if not bool((ids == self.encoder.image_token_id).any()):
            return None if self.deltas is None else (args, {**kwargs, "position_ids": self.shifted(kwargs, ids)})
        if positions is None:  # padded rows, one sample each: transformers' own call, padding left out
            found, self.deltas = self.rope_index(ids, self.grids.to(ids.device), kwargs.get("attention_mask"))
            return args, {**kwargs, "position_ids": found}
        return args, {**kwargs, "position_ids": self.per_sample(ids, positions, kwargs.get("sample_bounds"))}

    def rope_index(self, ids: torch.Tensor, grids: torch.Tensor,
                   padding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        kinds = (ids == self.encoder.image_token_id).int()  # transformers' mm_token_type_ids: 1 at an image's tokens
        found, deltas = self.encoder.base.get_rope_index(ids, kinds, image_grid_thw=grids, attention_mask=padding)
        return found, deltas

    def per_sample(self, ids: torch.Tensor, positions: torch.Tensor, bounds: Any) -> torch.Tensor:
        """[text, temporal, height, width] rows: the text row as given, the others each sample's own."""
        out, grids, used = positions.clone(), self.grids.to(ids.device), 0
        deltas = torch.zeros(ids.shape[0], 1, dtype=torch.long, device=ids.device)
        for row in range(ids.shape[0]):
            for start, end in bounds[row] if bounds else sample_bounds(positions[0, row]):
                sample = ids[row : row + 1, start:end]
                n_images = image_count(sample[0], self.encoder.image_token_id)
                if n_images:
                    found, delta = self.rope_index(sample, grids[used : used + n_images])
                    out[1:, row, start:end], deltas[row] = found[:, 0], delta[0]
                    used += n_images
        self.deltas = deltas
        return out

    def shifted(self, kwargs: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
        """A decoding step's positions: its text positions moved by its row's delta, on the three axes."""
        assert self.deltas is not None
        positions = kwargs.get("position_ids")
        if positions is None:
            cache = kwargs.get("past_key_values")
            seen = cache.get_seq_length() if cache is not None else 0
            text = torch.arange(seen, seen + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        else:
            text = positions[0] if positions.ndim == 3 else positions
        moved = (text + self.deltas.to(text.device)).unsqueeze(0).expand(3, -1, -1)
        return torch.cat([text.unsqueeze(0), moved])


def image_count(ids: torch.Tensor, image_token_id: int) -> int:
    """How many images a sample's ids hold: the runs of image tokens."""
    marks = (ids == image_token_id).int()
    return int((marks[1:] > marks[:-1]).sum()) + int(marks[0])


def deepstack_inputs(image_token_id: int, deepstack: list[torch.Tensor], module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Qwen3-VL's decoder adds the vision tower's intermediate features to the image tokens' hidden states after
    its first layers: handed to its forward where the image tokens are (none in a decoding step)."""
    ids = kwargs.get("input_ids")
    if ids is None or not bool((ids == image_token_id).any()):
        return None
    return args, {**kwargs, "visual_pos_masks": ids == image_token_id, "deepstack_visual_embeds": deepstack}


@contextmanager
def cross_attention_inputs(model: nn.Module, encoder: VisionEncoder, vision: dict[str, torch.Tensor] | None,
                           device: torch.device) -> Iterator[None]:
    """Within the block, the decoder's cross-attention layers read the micro-batch's images (CrossAttentionInputs)."""
    states = encoder.features(vision, device).features if vision is not None else None
    tiles = vision["aspect_ratio_mask"].sum(-1).tolist() if vision is not None else []
    hook = CrossAttentionInputs(encoder.image_token_id, states, tiles, encoder.max_tiles)
    handle = decoder_model(model).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


class CrossAttentionInputs:
    """Llama 3.2 Vision's cross-attention inputs for a micro-batch, as each sample alone gets them from transformers:
    a text token reads the images of its own sample from its image's token on (the processor's own rule, tiles past
    an image's own masked), and a token before its sample's first image reads all of that sample's image states
    evenly with the layer's MLP masked out (what transformers' masks make of a row with nothing to read). A
    text-only sample skips the layers in transformers; here every row has a zero state first (its key and value are
    zero, so a token reading only it adds nothing), so the layers run on every rank whatever its images, and FSDP2's
    gathers stay matched. Decoding steps read the prompt's cached states as its last token did."""

    def __init__(self, image_token_id: int, states: torch.Tensor | None, tiles: list[int], max_tiles: int) -> None:
        self.image_token_id, self.states, self.tiles, self.max_tiles = image_token_id, states, tiles, max_tiles
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # the prompt's last token's mask and MLP flag
        self.used = 0  # images of the micro-batch taken by the rows so far

    def __call__(self, module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        ids, cache = kwargs.get("input_ids"), kwargs.get("past_key_values")
        if ids is None:
            return None
        if self.last is not None and cache is not None and cache.get_seq_length() > 0:  # a decoding step
            mask, flag = (part[:, :, -1:].expand(-1, -1, ids.shape[1], -1) for part in self.last)
            return args, {**kwargs, "cross_attention_mask": mask, "full_text_row_masked_out_mask": flag}
        positions = kwargs.get("position_ids")
        bounds = kwargs.get("sample_bounds") or getattr(positions, "sample_bounds", None)
        if bounds is None:
            bounds = ([sample_bounds(row) for row in positions] if positions is not None
                      else [[(0, ids.shape[1])]] * ids.shape[0])
        self.used = 0
        embeddings = cast(Any, module).get_input_embeddings().weight
        states, mask, flag = batch_of([self.row(ids[row], bounds[row]) for row in range(ids.shape[0])],
                                      int(cast(Any, module).config.hidden_size), embeddings.dtype)
        self.last = (mask, flag)
        return args, {**kwargs, "cross_attention_states": states, "cross_attention_mask": mask,
                      "full_text_row_masked_out_mask": flag}

    def row(self, ids: torch.Tensor, bounds: list[tuple[int, int]]) -> CrossRow:
        """One row's image states and, per token, which of [zero state, those states] it reads."""
        pieces: list[torch.Tensor] = []
        allowed = torch.zeros(ids.shape[0], 1, dtype=torch.bool, device=ids.device)
        allowed[:, 0] = True  # the zero state, for text-only samples
        flag = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        for start, end in bounds:
            reads, sample_flag, states = self.sample(ids[start:end])
            if states is None:
                continue
            allowed[start:end, 0] = False
            before = sum(piece.shape[0] for piece in pieces)
            allowed = torch.cat([allowed, allowed.new_zeros(ids.shape[0], states.shape[0])], dim=1)
            allowed[start:end, 1 + before :] = reads
            flag[start:end] = sample_flag
            pieces.append(states)
        return CrossRow(torch.cat(pieces) if pieces else None, allowed, flag)

    def sample(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A sample's image states [its images x tiles x patches, hidden], which of them each token reads (the
        processor's rule), and which tokens have any to read (None states: a text-only sample)."""
        from transformers.models.mllama.processing_mllama import (
            convert_sparse_cross_attention_mask_to_dense,
            get_cross_attention_token_mask,
        )

        n_images = int((ids == self.image_token_id).sum())
        if n_images == 0 or self.states is None:
            return ids.new_zeros(0), ids.new_zeros(0), None
        taken = range(self.used, self.used + n_images)
        self.used += n_images
        sparse = get_cross_attention_token_mask(ids.tolist(), self.image_token_id)
        dense = convert_sparse_cross_attention_mask_to_dense([sparse], [[self.tiles[i] for i in taken]],
                                                             self.max_tiles, ids.shape[0])[0]
        patches = self.states.shape[1] // self.max_tiles
        reads = torch.from_numpy(dense).to(ids.device).bool().repeat_interleave(patches, dim=-1).flatten(1)
        flag = reads.any(-1)
        reads[~flag] = True  # nothing to read yet: all of its sample's states, evenly, as transformers' masks make it
        return reads, flag, self.states[list(taken)].flatten(0, 1)


@dataclass
class CrossRow:
    states: torch.Tensor | None  # [keys, hidden] of the row's images (None: text only)
    reads: torch.Tensor  # [tokens, 1 + keys]: which keys each token reads (the first: the zero state)
    flag: torch.Tensor  # [tokens]: whose cross-attention MLP counts (it had images to read)


def batch_of(rows: list[CrossRow], hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' inputs as the cross-attention layers take them: states [rows, 1 + keys, hidden] (zeros first and
    where a row has fewer keys), a boolean mask [rows, 1, tokens, 1 + keys] and the MLP's flag [rows, 1, tokens, 1]."""
    width = max(row.reads.shape[1] for row in rows)
    device = rows[0].reads.device
    states = torch.zeros(len(rows), width, hidden, dtype=dtype, device=device)
    mask = torch.zeros(len(rows), 1, rows[0].reads.shape[0], width, dtype=torch.bool, device=device)
    for index, row in enumerate(rows):
        if row.states is not None:
            states[index, 1 : 1 + row.states.shape[0]] = row.states.to(dtype)
        mask[index, 0, :, : row.reads.shape[1]] = row.reads
    flag = torch.stack([row.flag for row in rows])[:, None, :, None].to(dtype)
    return states, mask, flag
