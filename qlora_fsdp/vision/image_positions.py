"""Qwen-VL's rotary positions over three axes (temporal, height, width) for a micro-batch with images: each image
token at its place in its image's grid, the text after an image going on from the image's largest position, as the
family's own `get_rope_index` computes them; one sample at a time, so packed rows keep each sample's own.
vision/image_embeddings.py hooks it onto the decoder for the forwards that see images.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlora_fsdp.layers.attention import sample_bounds


class GridPositions:
    """For a family with rotary positions over three axes (Qwen-VL): the decoder's image tokens get the positions
    of their place in the image's grid, computed by the family's own `get_rope_index` one sample at a time (packed
    rows keep each sample's own), and the text after an image goes on from there. Generation's new tokens go on
    from the prompt's last position, as the family's `generate` does."""

    def __init__(self, base: Any, image_token_id: int, grids: torch.Tensor, part: Any = None) -> None:
        self.base, self.image_token_id, self.grids = base, image_token_id, grids  # base: the family's get_rope_index
        self.deltas: torch.Tensor | None = None  # per row: the last position minus the tokens, after a prompt
        self.part = part  # a split row's part (image_embeddings.RowPart): positions from the whole row, then cut

    def __call__(self, module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        if ids is None:
            return None
        if self.part is not None and positions is not None:  # images anywhere in the row move its positions
            bounds = kwargs.get("sample_bounds") or getattr(positions, "sample_bounds", None)
            assert bounds is not None, "a split row's positions carry the whole row's sample bounds"
            return args, {**kwargs, "position_ids": self.part_of_row(positions, bounds[0])}
        if not bool((ids == self.image_token_id).any()):
            return None if self.deltas is None else (args, {**kwargs, "position_ids": self.shifted(kwargs, ids)})
        if positions is None:  # padded rows, one sample each: transformers' own call, padding left out
            found, self.deltas = self.rope_index(ids, self.grids.to(ids.device), kwargs.get("attention_mask"))
            return args, {**kwargs, "position_ids": found}
        return args, {**kwargs, "position_ids": self.per_sample(ids, positions, kwargs.get("sample_bounds"))}

    def rope_index(self, ids: torch.Tensor, grids: torch.Tensor,
                   padding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        kinds = (ids == self.image_token_id).int()  # transformers' mm_token_type_ids: 1 at an image's tokens
        found, deltas = self.base.get_rope_index(ids, kinds, image_grid_thw=grids, attention_mask=padding)
        return found, deltas

    def per_sample(self, ids: torch.Tensor, positions: torch.Tensor, bounds: Any) -> torch.Tensor:
        """[text, temporal, height, width] rows: the text row as given, the others each sample's own."""
        out, grids, used = positions.clone(), self.grids.to(ids.device), 0
        deltas = torch.zeros(ids.shape[0], 1, dtype=torch.long, device=ids.device)
        for row in range(ids.shape[0]):
            for start, end in bounds[row] if bounds else sample_bounds(positions[0, row]):
                sample = ids[row : row + 1, start:end]
                n_images = image_count(sample[0], self.image_token_id)
                if n_images:
                    found, delta = self.rope_index(sample, grids[used : used + n_images])
                    out[1:, row, start:end], deltas[row] = found[:, 0], delta[0]
                    used += n_images
        self.deltas = deltas
        return out

    def part_of_row(self, positions: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """A split row's part: the whole row's positions (each sample's from 0, as the row's bounds say) on the
        three axes, cut to the part; the text row as given."""
        row_ids = self.part.row_ids.to(positions.device)
        text = torch.cat([torch.arange(end - start, device=positions.device) for start, end in bounds])
        whole = self.per_sample(row_ids[None], text.view(1, 1, -1).expand(4, 1, -1), [bounds])
        out = positions.clone()
        out[1:] = whole[1:, :, self.part.start : self.part.start + positions.shape[-1]]
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
