"""Llama 3.2 Vision's images, read by its decoder's cross-attention layers: the tiles' states of a micro-batch's images
and, for every text token, which of them it reads, as each sample alone gets them from transformers (the
processor's own masking rule); packed rows keep each token to its own sample's images. vision/image_embeddings.py
hooks it onto the decoder for every forward of such a model, with images or without.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from qlora_fsdp.layers.attention import sample_bounds


@contextmanager
def cross_attention_inputs(decoder: nn.Module, image_token_id: int, max_tiles: int, states: torch.Tensor | None,
                           tiles: list[int]) -> Iterator[None]:
    """Within the block, the decoder's cross-attention layers read the micro-batch's image states (None: it has
    none) of `tiles` tiles each (CrossAttentionInputs)."""
    hook = CrossAttentionInputs(image_token_id, states, tiles, max_tiles)
    handle = decoder.register_forward_pre_hook(hook, with_kwargs=True)
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
