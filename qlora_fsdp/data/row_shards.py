"""A micro-batch split over the ranks that share its rows (context parallel): each rank's contiguous part of the
batch laid out as one long row, as the per-sample kernel takes packed rows. Labels are shifted per sample before
the split, so a target whose token lies in the next rank's part is still this rank's target; position ids are
each token's own; the sample bounds the attention reads are the whole row's (layers/split_rows.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qlora_fsdp.data.batching import Batch, Sample, collate_packed
from qlora_fsdp.data.templates import IGNORE_INDEX


@dataclass
class RowShard(Batch):
    """One rank's part of a micro-batch (a Batch of one row); counts are the part's, so summing them over the
    ranks gives the whole batch's (its samples are counted by the first part)."""

    whole_bounds: list[tuple[int, int]] = field(default_factory=list)  # the whole row's samples, [start, end)
    owners: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # each position's sample
    real: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # 1 at sample tokens

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
    assert batch.vision is None and batch.reference_logps is None, "refused at load with context parallel"
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
    return RowShard(ids[part].view(1, width), local_labels, int((local_labels != IGNORE_INDEX).sum()),
                    int(real[part].sum()), batch.n_samples if index == 0 else 0,
                    position_ids=positions[part].view(1, width), segments=[[end - start for start, end in bounds]],
                    row_samples=[batch.n_samples], whole_bounds=bounds, owners=owners[part],
                    real=real[part].view(1, width))
