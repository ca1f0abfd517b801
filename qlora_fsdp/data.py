"""Alpaca JSONL -> prompt-masked token sequences -> padded micro-batches, with a resumable sampler.

Labels are shifted here (labels[t] is the token after input[t]), so the loss is a plain token-wise
sum over the logits with no slicing copies; prompt and padding positions are IGNORE_INDEX.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from qlora_fsdp.config import DataConfig
from qlora_fsdp.errors import DataError

IGNORE_INDEX = -100
ALPACA_FIELDS = ("instruction", "output")
TEMPLATES = {
    "alpaca": ("### Instruction:\n{instruction}\n\n### Response:\n",
               "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"),
}


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]  # unshifted: IGNORE_INDEX on prompt tokens


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor  # shifted targets
    n_targets: int  # positions that count in the loss
    n_tokens: int  # non-padding input tokens


@dataclass
class Dataset:
    train: list[Sample]
    eval: list[Sample]
    n_truncated: int = 0


def read_alpaca(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise DataError(f"data.path {path} does not exist")
    records = []
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
            for name in ALPACA_FIELDS:
                if not isinstance(record, dict) or not isinstance(record.get(name), str):
                    raise DataError(f"{path}:{line_no}: record lacks the text field '{name}'")
            records.append(record)
    if not records:
        raise DataError(f"{path} holds no records")
    return records


def format_prompt(record: dict[str, str], template: str) -> str:
    without_input, with_input = TEMPLATES[template]
    if record.get("input"):
        return with_input.format(instruction=record["instruction"], input=record["input"])
    return without_input.format(instruction=record["instruction"])


def tokenize(record: dict[str, str], tokenizer: PreTrainedTokenizerBase, data: DataConfig) -> tuple[Sample, bool]:
    """Prompt tokens are masked out of the loss; returns (sample, was_truncated)."""
    prompt = tokenizer(format_prompt(record, data.template), add_special_tokens=False)["input_ids"]
    response = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if tokenizer.bos_token_id is not None:
        prompt = [tokenizer.bos_token_id] + prompt
    ids = (prompt + response)[: data.context_length]
    labels = ([IGNORE_INDEX] * len(prompt) + response)[: data.context_length]
    return Sample(ids, labels), len(prompt) + len(response) > data.context_length


def load_dataset(tokenizer: PreTrainedTokenizerBase, data: DataConfig, seed: int) -> Dataset:
    """Tokenize every record; hold out `eval_samples` chosen by the seed."""
    records = read_alpaca(Path(data.path))
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    samples, n_truncated = [], 0
    for index in order:
        sample, truncated = tokenize(records[index], tokenizer, data)
        n_truncated += truncated
        if any(label != IGNORE_INDEX for label in sample.labels[1:]):
            samples.append(sample)
    n_eval = min(data.eval_samples, len(samples) // 10)
    if len(samples) - n_eval < 1:
        raise DataError(f"{data.path}: no trainable samples left after truncation to {data.context_length} tokens")
    return Dataset(train=samples[n_eval:], eval=samples[:n_eval], n_truncated=n_truncated)


def collate(samples: list[Sample], pad_id: int) -> Batch:
    """Right-pad to the longest sample; shift labels so position t predicts token t+1."""
    length = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = torch.tensor(sample.input_ids)
        attention_mask[row, :n] = 1
        labels[row, : n - 1] = torch.tensor(sample.labels[1:])
    n_targets = int((labels != IGNORE_INDEX).sum())
    return Batch(input_ids, attention_mask, labels, n_targets, int(attention_mask.sum()))


@dataclass
class StepSampler:
    """Deterministic order (seed, epoch, position) over the training set, split over ranks per step.

    Each optimizer step takes the next micro_batch_size * grad_accum_steps * world_size samples of the
    epoch's permutation; rank r takes its contiguous part, cut into micro-batches.
    """

    n_samples: int
    micro_batch_size: int
    grad_accum_steps: int
    world_size: int
    rank: int
    seed: int
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    def _epoch_order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n_samples, generator=generator).tolist()

    def next_step(self) -> list[list[int]]:
        """Sample indices of this rank's micro-batches for the next optimizer step."""
        indices = []
        while len(indices) < self.samples_per_step:
            if not self._order or self.position >= self.n_samples:
                if self._order:  # epoch finished
                    self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order()
            take = min(self.samples_per_step - len(indices), self.n_samples - self.position)
            indices.extend(self._order[self.position : self.position + take])
            self.position += take
        per_rank = self.micro_batch_size * self.grad_accum_steps
        mine = indices[self.rank * per_rank : (self.rank + 1) * per_rank]
        return [mine[i : i + self.micro_batch_size] for i in range(0, per_rank, self.micro_batch_size)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order()
