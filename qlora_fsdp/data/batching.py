"""Tokenized samples -> micro-batches: padded or packed rows, and the resumable step sampler.

Labels are shifted here (labels[t] is the token after input[t]), per sample, so in a packed row no
sample's first token is ever a target of the sample before it. Packed rows carry position ids that
restart at 0 for each sample and no attention mask: attention then stays within each sample, per sample
(sdpa_varlen, flash_attention_2) or under a block-diagonal mask (sdpa, eager, flex); see layers/attention.py.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from qlora_fsdp.data.templates import IGNORE_INDEX


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]  # unshifted: IGNORE_INDEX where the token is not a target
    # a record with images: the checkpoint's processor's image inputs (pixel_values, and what the family needs
    # beside them), one entry an image along the first dimension, in the order the image tokens come
    vision: dict[str, torch.Tensor] | None = None


def joined_vision(samples: list[Sample]) -> dict[str, torch.Tensor] | None:
    """The image inputs of these samples in the order their image tokens come in the batch; None without images."""
    return joined_images([s.vision for s in samples])


def joined_images(inputs: list[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor] | None:
    """Rows' image inputs (None: a row without) as one batch's, in the rows' order; None without images."""
    parts = [part for part in inputs if part is not None]
    if not parts:
        return None
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor  # shifted targets
    n_targets: int  # positions that count in the loss
    n_tokens: int  # non-padding tokens
    n_samples: int
    attention_mask: torch.Tensor | None = None  # padded rows
    position_ids: torch.Tensor | None = None  # packed rows
    segments: list[list[int]] | None = None  # packed rows: each row's sample lengths, then its padding tail
    row_samples: list[int] | None = None  # packed rows: how many of each row's segments are samples
    vision: dict[str, torch.Tensor] | None = None  # the rows' images, in the order their image tokens come
    # preference pairs whose reference log-probabilities were computed before training: per sequence, in order
    reference_logps: torch.Tensor | None = None
    desirable: torch.Tensor | None = None  # kto: each pair's (record's) label, bool, in order
    margin: torch.Tensor | None = None  # reward: each pair's margin (its record's `margin`), in order
    # flat indices of the target tokens, the only positions the output layer and the loss need; found when the
    # batch is made (on the host, with real values: the planner runs the step on fake tensors)
    target_positions: torch.Tensor = field(init=False, repr=False)
    target_sample_ids: torch.Tensor = field(init=False, repr=False)  # target_samples(), found here likewise
    sample_targets: torch.Tensor = field(init=False, repr=False)  # targets_per_sample(), likewise

    def __post_init__(self) -> None:
        self.target_positions = torch.nonzero(self.labels.flatten() != IGNORE_INDEX).flatten()
        self.target_sample_ids = self.sample_of_each_target()
        self.sample_targets = torch.bincount(self.target_sample_ids, minlength=self.n_samples)

    def model_inputs(self, device: torch.device, one_row: bool = False) -> dict[str, torch.Tensor | bool]:
        """`one_row`: packed rows go in as one long row (for kernels that find sample bounds in a single row's
        position ids); the loss flattens logits and labels alike, so its sum is unchanged."""
        # no KV cache: with one, transformers would not build the packed rows' block-diagonal mask
        inputs: dict[str, torch.Tensor | bool] = {"input_ids": self.input_ids.to(device), "use_cache": False}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask.to(device)
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids.to(device)
            if one_row:
                inputs["input_ids"], inputs["position_ids"] = (
                    self.input_ids.view(1, -1).to(device), self.position_ids.view(1, -1).to(device))
        return inputs

    def numbered_samples(self) -> int:
        """How many samples the per-sample results are numbered over (a split row's part: the whole row's)."""
        return self.n_samples

    def whole_batch_targets(self) -> int:
        """The target tokens of the whole batch (a split row's part: of the whole row)."""
        return self.n_targets

    def targets_before(self) -> int:
        """Target tokens of the whole batch before this one's first (a split row's part: its offset in the row's
        targets, which are in order)."""
        return 0

    def counts_once(self) -> bool:
        """Whether the per-sample results (a pair's loss, its rewards) count in the step's sums from this batch: a
        split row's ranks all hold them whole, and only its first part counts them."""
        return True

    def last_token_samples(self) -> torch.Tensor:
        """The samples whose last token last_tokens() gives, in its order (a split row's part: those it holds)."""
        return torch.arange(self.n_samples)

    def target_samples(self) -> torch.Tensor:
        """For each target position (target_positions' order), the index of its sample in the batch, counted row
        by row: a padded batch's row, or a packed row's samples in order (a padding tail holds no targets)."""
        return self.target_sample_ids

    def targets_per_sample(self) -> torch.Tensor:
        """How many target tokens each sample of the batch has, in target_samples()' numbering (a split row's
        part: each sample's in the whole row)."""
        return self.sample_targets

    def sample_of_each_target(self) -> torch.Tensor:
        return self.position_samples()[self.target_positions]

    def position_samples(self) -> torch.Tensor:
        """Every flat position's sample in the batch (target_samples()' numbering)."""
        rows, width = self.input_ids.shape
        if self.segments is None or self.row_samples is None:
            return torch.arange(rows * width) // width
        owner = torch.empty(rows * width, dtype=torch.long)
        first = 0  # index of the row's first sample
        for row, (lengths, n) in enumerate(zip(self.segments, self.row_samples, strict=True)):
            # the padding tail takes its row's last sample's index (no target points at it)
            ids = torch.arange(first, first + len(lengths)).clamp(max=max(first + n - 1, 0))
            owner[row * width : (row + 1) * width] = torch.repeat_interleave(ids, torch.tensor(lengths))
            first += n
        return owner

    def real_tokens(self) -> torch.Tensor:
        """1 at every token of a sample, 0 at padding (a padded row's tail, a packed row's), in the rows' shape."""
        if self.segments is None or self.row_samples is None:
            return self.attention_mask if self.attention_mask is not None else torch.ones_like(self.input_ids)
        mask = torch.zeros_like(self.input_ids)
        for row, (lengths, n) in enumerate(zip(self.segments, self.row_samples, strict=True)):
            mask[row, : sum(lengths[:n])] = 1
        return mask

    def last_tokens(self) -> torch.Tensor:
        """The flat position of each sample's last token (target_samples()' numbering): where a reward model scores
        it."""
        rows, width = self.input_ids.shape
        if self.segments is None or self.row_samples is None:
            return torch.arange(rows) * width + self.real_tokens().sum(1) - 1
        ends = [row * width + end - 1 for row, (lengths, n) in enumerate(zip(self.segments, self.row_samples,
                                                                             strict=True))
                for end in accumulate(lengths[:n])]
        return torch.tensor(ends, dtype=torch.long)

    def sample_bounds(self, one_row: bool = False) -> list[list[tuple[int, int]]]:
        """[start, end) of every sample (and padding tail) of each packed row, or of the one long row; from the
        lengths, so no tensor is read."""
        assert self.segments is not None, "packed rows"
        width = self.input_ids.shape[1]
        rows = []
        for index, lengths in enumerate(self.segments):
            edges = list(accumulate(lengths, initial=index * width if one_row else 0))
            rows.append(list(zip(edges[:-1], edges[1:], strict=True)))
        return [[bound for row in rows for bound in row]] if one_row else rows


def shifted(sample: Sample) -> list[int]:
    return sample.labels[1:] + [IGNORE_INDEX]


def collate(samples: list[Sample], pad_id: int) -> Batch:
    """One sample a row, right-padded to the longest."""
    length = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = torch.tensor(sample.input_ids)
        attention_mask[row, :n] = 1
        labels[row, :n] = torch.tensor(shifted(sample))
    n_targets = int((labels != IGNORE_INDEX).sum())
    return Batch(input_ids, labels, n_targets, int(attention_mask.sum()), len(samples), attention_mask=attention_mask,
                 vision=joined_vision(samples))


def collate_packed(rows: list[list[Sample]], pad_id: int, length: int | None = None) -> Batch:
    """Several samples a row; the padding tail is a block of its own (positions from 0, no targets). Rows are
    as long as the longest, or `length`."""
    length = max([sum(len(s.input_ids) for s in row) for row in rows] + [length or 0])
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), length), dtype=torch.long)
    n_tokens = 0
    segments = []
    for r, row in enumerate(rows):
        start = 0
        for sample in row:
            n = len(sample.input_ids)
            input_ids[r, start : start + n] = torch.tensor(sample.input_ids)
            labels[r, start : start + n] = torch.tensor(shifted(sample))
            position_ids[r, start : start + n] = torch.arange(n)
            start += n
        position_ids[r, start:] = torch.arange(length - start)
        n_tokens += start
        segments.append([len(s.input_ids) for s in row] + ([length - start] if length > start else []))
    n_targets = int((labels != IGNORE_INDEX).sum())
    return Batch(input_ids, labels, n_targets, n_tokens, sum(map(len, rows)), position_ids=position_ids,
                 segments=segments, row_samples=[len(row) for row in rows],
                 vision=joined_vision([s for row in rows for s in row]))


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each sample (longest first) goes to the fullest row it still fits; deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, row index), sorted
    for index in order:
        spot = bisect.bisect_left(free, (lengths[index], -1))
        if spot == len(free):
            rows.append([index])
            row_free = capacity - lengths[index]
            row = len(rows) - 1
        else:
            row_free, row = free.pop(spot)
            rows[row].append(index)
            row_free -= lengths[index]
        if row_free > 0:
            bisect.insort(free, (row_free, row))
    return rows


@dataclass
class StepSampler:
    """Deterministic order (seed, epoch, position) over the training units (samples, or packed rows).

    Each optimizer step takes the next micro_batch_size * grad_accum_steps * world_size units of the
    epoch's permutation. With `lengths`, the step's units are sorted by length before they are cut into
    micro-batches (less padding; the step's gradient is the same, as the loss is normalized per step).
    """

    n_units: int
    micro_batch_size: int
    grad_accum_steps: int
    world_size: int
    rank: int
    seed: int
    lengths: list[int] | None = None
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    @property
    def units_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    def _epoch_order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n_units, generator=generator).tolist()

    def _next_units(self) -> list[int]:
        units: list[int] = []
        while len(units) < self.units_per_step:
            if not self._order or self.position >= self.n_units:
                if self._order:  # epoch finished
                    self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order()
            take = min(self.units_per_step - len(units), self.n_units - self.position)
            units.extend(self._order[self.position : self.position + take])
            self.position += take
        return units

    def next_step(self) -> list[list[int]]:
        """Unit indices of this rank's micro-batches for the next optimizer step."""
        units = self._next_units()
        lengths = self.lengths
        if lengths is not None:
            units.sort(key=lambda unit: lengths[unit])
        chunks = [units[i : i + self.micro_batch_size] for i in range(0, len(units), self.micro_batch_size)]
        return chunks[self.rank :: self.world_size]  # ranks take turns, so each rank's lengths are alike

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._epoch_order()
