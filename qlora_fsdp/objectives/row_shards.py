"""A micro-batch split over the ranks that share its rows (context parallel): each rank's contiguous part of the
batch laid out as one long row, as the per-sample kernel takes packed rows. Labels are shifted per sample before
the split, so a target whose token lies in the next rank's part is still this rank's target; position ids are
each token's own; the sample bounds the attention reads are the whole row's (layers/split_rows.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qlora_fsdp.data.batching import Batch, Sample, collate_packed
from qlora_fsdp.data.templates import IGNORE_INDEX
from qlora_fsdp.distributed.row_groups import RowSplit


@dataclass
class RowShard(Batch):
    """One rank's part of a micro-batch (a Batch of one row); counts are the part's, so summing them over the
    ranks gives the whole batch's (its samples are counted by the first part). Per-sample results are numbered
    over the whole batch's samples (each rank adds its parts, distributed/split_sums.py)."""

    whole_bounds: list[tuple[int, int]] = field(default_factory=list)  # the whole row's samples, [start, end)
    owners: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # each position's sample
    real: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # 1 at sample tokens
    whole_samples: int = 0  # the whole batch's samples
    part: int = 0  # this part's index in the row
    last_positions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # here
    last_samples: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # theirs
    whole_targets: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # a sample's
    row_ids: torch.Tensor | None = None  # with images: the whole row's ids (where its images' tokens are)
    part_start: int = 0  # this part's first token in the row
    preceding_targets: int = 0  # the row's target tokens before this part

    def numbered_samples(self) -> int:
        return self.whole_samples

    def whole_batch_targets(self) -> int:
        return int(self.whole_targets.sum())

    def targets_before(self) -> int:
        return self.preceding_targets

    def counts_once(self) -> bool:
        return self.part == 0

    def targets_per_sample(self) -> torch.Tensor:
        return self.whole_targets

    def last_tokens(self) -> torch.Tensor:
        return self.last_positions

    def last_token_samples(self) -> torch.Tensor:
        return self.last_samples

    def position_samples(self) -> torch.Tensor:
        return self.owners

    def real_tokens(self) -> torch.Tensor:
        return self.real

    def sample_bounds(self, one_row: bool = False) -> list[list[tuple[int, int]]]:
        return [self.whole_bounds]


def one_row_per_sample(samples: list[Sample], pad_id: int) -> Batch:
    """Padded micro-batches in the packed layout (a sample a row, its padding a block of its own): the same loss,
    and the form a split needs (position ids and sample bounds)."""
    return collate_packed([[sample] for sample in samples], pad_id)


def shard_row(batch: Batch, degree: int, index: int, pad_id: int) -> RowShard:
    """Part `index` of `degree` of the batch's rows laid end to end; padded with a block of its own to a multiple
    of `degree` tokens."""
    assert batch.position_ids is not None and batch.segments is not None, "packed layout (one_row_per_sample)"
    ids, labels = batch.input_ids.flatten(), batch.labels.flatten()
    positions, owners, real = batch.position_ids.flatten(), batch.position_samples(), batch.real_tokens().flatten()
    bounds = batch.sample_bounds(one_row=True)[0]
    extra = -ids.numel() % degree
    if extra:
        ids = torch.cat([ids, ids.new_full((extra,), pad_id)])
        labels = torch.cat([labels, labels.new_full((extra,), IGNORE_INDEX)])
        positions = torch.cat([positions, torch.arange(extra)])
        owners = torch.cat([owners, owners[-1:].expand(extra)])
        real = torch.cat([real, real.new_zeros(extra)])
        bounds = [*bounds, (bounds[-1][1], bounds[-1][1] + extra)]
    width = ids.numel() // degree
    part = slice(index * width, (index + 1) * width)
    local_labels = labels[part].view(1, width)
    last = batch.last_tokens()  # flat positions, and so positions in the row the batch's rows make end to end
    here = (last >= part.start) & (last < part.stop)
    return RowShard(ids[part].view(1, width), local_labels, int((local_labels != IGNORE_INDEX).sum()),
                    int(real[part].sum()), batch.n_samples if index == 0 else 0,
                    position_ids=positions[part].view(1, width), segments=[[end - start for start, end in bounds]],
                    row_samples=[batch.n_samples], reference_logps=batch.reference_logps, desirable=batch.desirable,
                    margin=batch.margin, whole_bounds=bounds, owners=owners[part], real=real[part].view(1, width),
                    whole_samples=batch.n_samples, part=index, last_positions=last[here] - part.start,
                    last_samples=torch.nonzero(here).flatten(), whole_targets=batch.targets_per_sample(),
                    vision=batch.vision, row_ids=ids if batch.vision is not None else None, part_start=part.start,
                    preceding_targets=int((labels[: part.start] != IGNORE_INDEX).sum()))


def row_part(batch: Batch, split: RowSplit, pad_id: int) -> Batch:
    """This rank's part of a packed batch under its split; the batch itself without one."""
    return shard_row(batch, split.degree, split.index, pad_id) if split.splits else batch


def split_filler(pad_id: int, degree: int, index: int) -> RowShard:
    """A row of padding split alike: what a split's ranks run together to keep their collectives in step with
    ranks that still have samples."""
    filler = Sample([pad_id] * degree, [IGNORE_INDEX] * degree)
    return shard_row(one_row_per_sample([filler], pad_id), degree, index, pad_id)
