"""What the trainer reads from any kind of data (SFT samples, samples with images, preference pairs, GRPO's
prompts), and the one rule that holds out part of it."""

from __future__ import annotations

import math
import random
from typing import Any, Protocol

from qlora_fsdp.config import OverlongPolicy
from qlora_fsdp.errors import DataError


class TrainingData(Protocol):
    """A kind of data as the trainer reads it: units (a sample, a pair, a packed row, a prompt) the sampler draws,
    their lengths, the samples behind them, and the held-out split."""

    train: Any
    eval: Any

    @property
    def packs(self) -> list[list[int]] | None:
        """With packing: the train samples of each row."""

    @property
    def n_units(self) -> int: ...

    @property
    def has_images(self) -> bool:
        """Whether any unit shows images (the image side is then loaded beside the decoder)."""

    def unit_lengths(self) -> list[int]: ...

    def samples(self, split: Any, indices: list[int]) -> list[Any]: ...

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
