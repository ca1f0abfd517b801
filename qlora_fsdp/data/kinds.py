"""What the trainer reads from any kind of data (SFT samples, samples with images, preference pairs, GRPO's
prompts), and the one rule that holds out part of it."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sized
from typing import Any, Protocol, TypeVar

from qlora_fsdp.config import OverlongPolicy
from qlora_fsdp.errors import DataError

# what a kind's train and held-out sets each are: tokenized rows (datasets.Dataset, SFT's and the pairs'), samples
# in memory (list[Sample], with images), or GRPO's Prompts
Split = TypeVar("Split", bound=Sized)


class TrainingData(Protocol[Split]):
    """A kind of data as the trainer reads it: units (a sample, a pair, a packed row, a prompt) the sampler draws,
    their lengths, the samples behind them, and the held-out split. An objective names the split it reads
    (GRPO: TrainingData[Prompts]), so it reads its kind's own without checking the class."""

    @property
    def train(self) -> Split: ...

    @property
    def eval(self) -> Split: ...

    @property
    def template(self) -> str:
        """The template the units were rendered with ("processor": the checkpoint's processor)."""

    @property
    def packs(self) -> list[list[int]] | None:
        """With packing: the train samples of each row."""

    @property
    def n_units(self) -> int: ...

    @property
    def has_images(self) -> bool:
        """Whether any unit shows images (the image side is then loaded beside the decoder)."""

    def unit_lengths(self) -> list[int]: ...

    def samples(self, split: Split, indices: list[int]) -> list[Any]: ...

    def describe(self, context_length: int, overlong: OverlongPolicy) -> str: ...


def held_out_split(n: int, eval_samples: int, seed: int, n_eval_file: int | None = None) -> tuple[list[int], list[int]]:
    """(train indices in training order, held-out indices), by the seed. Without an eval file, at most a tenth of
    the records (and none of a single one) is held out, so a small set is never mostly held out; with one
    (`n_eval_file` records in data.eval_path), every record trains and eval_samples of the file's are held out."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    if n_eval_file is not None:
        return order, sorted(random.Random(seed).sample(range(n_eval_file), min(eval_samples, n_eval_file)))
    n_eval = min(eval_samples, math.ceil(n / 10)) if n > 1 else 0
    return order[n_eval:], order[:n_eval]


def check_trainable(n_train: int, unit: str) -> None:
    if not n_train:
        raise DataError(f"every {unit} went to the held-out set; lower data.eval_samples or add data")


def held_out_sets(units: Split, held_out: Split | None, select: Callable[[Split, list[int]], Split],
                  eval_samples: int, seed: int, unit: str) -> tuple[Split, Split]:
    """(train, held out) of any kind, by held_out_split: `held_out` is data.eval_path's units (None: they are held
    out of `units`); `select` takes a set's units at indices; `unit` names one in the error of nothing to train."""
    train, picked = held_out_split(len(units), eval_samples, seed, None if held_out is None else len(held_out))
    check_trainable(len(train), unit)
    return select(units, train), select(units if held_out is None else held_out, picked)
