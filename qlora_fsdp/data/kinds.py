"""What the trainer reads from any kind of data (SFT samples, samples with images, preference pairs, GRPO's
prompts), and the one rule that holds out part of it."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sized
from typing import Any, Protocol, TypeVar

from qlora_fsdp.config import OverlongPolicy
from qlora_fsdp.errors import DataError

# a kind's train and held-out sets: tokenized rows (datasets.Dataset), list[Sample] (with images), or Prompts
Split = TypeVar("Split", bound=Sized)


class TrainingData(Protocol[Split]):
    """A kind of data as the trainer reads it: units (a sample, a pair, a packed row, a prompt) the sampler draws,
    their lengths, the samples behind them, and the held-out split. An objective names the split it reads
    (GRPO: TrainingData[Prompts]), so it reads its kind's own without checking the class."""

    train: Split
    eval: Split

    @property
    def template(self) -> str: ...  # what rendered the units: a template's name, or "processor" (the checkpoint's)

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


def held_out_sets(units: Split, held_out: Split | None, select: Callable[[Split, list[int]], Split],
                  eval_samples: int, seed: int, unit: str) -> tuple[Split, Split]:
    """(train, held out) of any kind, by the seed: `select` takes a set's units at indices (the train ones come in
    the seed's order). Without an eval file (`held_out` None), at most a tenth of the units (and none of a single
    one) is held out, so a small set is never mostly held out; with one (data.eval_path's units in `held_out`),
    every unit trains and eval_samples of the file's are held out. `unit` names one where none is left to train."""
    order = list(range(len(units)))
    random.Random(seed).shuffle(order)
    if held_out is not None:
        n_file = len(held_out)
        train, picked = order, sorted(random.Random(seed).sample(range(n_file), min(eval_samples, n_file)))
    else:
        n_eval = min(eval_samples, math.ceil(len(units) / 10)) if len(units) > 1 else 0
        train, picked = order[n_eval:], order[:n_eval]
    if not train:
        raise DataError(f"every {unit} went to the held-out set; lower data.eval_samples or add data")
    return select(units, train), select(units if held_out is None else held_out, picked)
