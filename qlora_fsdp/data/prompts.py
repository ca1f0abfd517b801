"""GRPO's prompts: records with a `prompt` (plain text, or chat messages that the template renders with the
generation prompt, as TRL does) and any other columns, which reach the reward functions as keyword arguments.

Plain text is tokenized as it is (the tokenizer's own BOS and nothing else: TRL's way); give chat messages to have
the chat template applied. Prompts longer than data.context_length - generation.max_completion_length tokens leave
no room for a completion and are refused in one line naming the record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase, ProcessorMixin

from qlora_fsdp.config import Config, DataConfig, SourceConfig
from qlora_fsdp.data.kinds import held_out_sets
from qlora_fsdp.data.pipeline import run_template
from qlora_fsdp.data.prompt_images import encode_image_prompt, prompts_have_images
from qlora_fsdp.data.sources import eval_source, read_source, sources_of, weighted
from qlora_fsdp.data.templates import prompt_ids
from qlora_fsdp.errors import DataError

RESERVED = ("prompt", "completion", "completion_ids")  # TRL passes every other column to the reward functions
# a record and where it is (named in errors) -> its prompt as rendered with tools, and their schemas (the recipe's
# tools, which objectives/tool_templates.py finds: data/ does not import agents/)
PromptTools = Callable[[dict[str, Any], str], tuple[Any, list[dict[str, Any]]]]
# a record and where it is -> its prompt's ids, the prompt as the reward functions get it, its image inputs or None
Encoder = Callable[[dict[str, Any], str], tuple[list[int], Any, dict[str, torch.Tensor] | None]]


@dataclass
class Prompts:
    """Tokenized prompts and what the reward functions see of each record."""

    ids: list[list[int]]
    prompts: list[Any]  # as the reward functions get them: the text, or the messages
    columns: dict[str, list[Any]]  # every other column of the records
    records: list[int]  # each prompt's index in the data (error messages name it)
    vision: list[dict[str, torch.Tensor] | None] | None = None  # each prompt's image inputs (a checkpoint's images)

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, indices: list[int]) -> Prompts:
        return Prompts([self.ids[i] for i in indices], [self.prompts[i] for i in indices],
                       {name: [values[i] for i in indices] for name, values in self.columns.items()},
                       [self.records[i] for i in indices],
                       None if self.vision is None else [self.vision[i] for i in indices])

    def images_of(self, index: int) -> dict[str, torch.Tensor] | None:
        return None if self.vision is None else self.vision[index]


@dataclass
class PromptData:
    """The trainer's view of GRPO's data: a unit is a prompt (its completions are made at each step)."""

    train: Prompts
    eval: Prompts
    template: str
    packs: None = None

    @property
    def has_images(self) -> bool:
        return any(v is not None for split in (self.train, self.eval) for v in split.vision or [])

    @property
    def n_units(self) -> int:
        return len(self.train)

    def unit_lengths(self) -> list[int]:
        return [len(ids) for ids in self.train.ids]

    def samples(self, split: Any, indices: list[int]) -> list[Any]:
        """No fixed samples: completions are generated (the trainer's held-out loss has none to score)."""
        return []

    def describe(self, context_length: int, overlong: str) -> str:
        images = sum(v is not None for split in (self.train, self.eval) for v in split.vision or [])
        shown = f" ({images} with images)" if images else ""
        return (f"{len(self.train) + len(self.eval)} prompts{shown}, {len(self.train)} train / {len(self.eval)} held "
                f"out (template {self.template})")


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def encode_prompt(prompt: Any, tokenizer: PreTrainedTokenizerBase, template: str, where: str,
                  tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt's tokens; `tools`: the schemas it shows (a rollout that calls tools: chat prompts only)."""
    if is_chat(prompt):
        return prompt_ids(list(prompt), tokenizer, template, tools)  # type: ignore[arg-type]
    if isinstance(prompt, str) and prompt:
        return list(tokenizer(prompt)["input_ids"])
    raise DataError(f"{where}: 'prompt' must be text or a list of chat messages, got {type(prompt).__name__}")


def with_prompt_column(records: datasets.Dataset, source: SourceConfig) -> datasets.Dataset:
    """The source's columns under the names GRPO reads (data.fields: {prompt: question} reads GSM8K's questions;
    {answer: solution, image: decoded_image} names the columns a reward function or the images are read from)."""
    for name, column in source.fields.items():
        if column == name:
            continue
        if column not in records.column_names:
            if name == "prompt":  # the missing prompt column is named below, with the records' columns
                continue
            raise DataError(f"{source.path}: data.fields maps {name} to a column '{column}' the records lack; they "
                            f"have {records.column_names}")
        if name in records.column_names:
            records = records.remove_columns(name)
        records = records.rename_column(column, name)
    return records


def read_prompts(sources: list[SourceConfig], data: DataConfig, seed: int) -> datasets.Dataset:
    """Every source's records, each repeated or subsampled by its weight, as SFT data is mixed."""
    parts = [weighted(with_prompt_column(read_source(source, data.cache_dir), source), source.weight, seed)
             for source in sources]
    records = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if "prompt" not in records.column_names:
        raise DataError(f"{sources[0].path}: GRPO reads a 'prompt' column (or data.fields: {{prompt: <column>}}); "
                        f"the records have {records.column_names}")
    return records


def encoded_prompts(records: datasets.Dataset, path: str, encode: Encoder, room: int, images: bool) -> Prompts:
    """Every record's prompt through `encode`, in the data's order, each refused in one line where it leaves a
    completion no room (more than `room` tokens); `images`: their image inputs kept (a checkpoint's images)."""
    ids, prompts, vision = [], [], []
    for index, record in enumerate(records):
        where = f"{path} record {index + 1}"
        encoded, prompt, inputs = encode(record, where)
        if len(encoded) > room:
            raise DataError(f"{where}: the prompt has {len(encoded)} tokens, more than data.context_length - "
                            f"generation.max_completion_length = {room}; raise data.context_length or shorten it")
        ids.append(encoded)
        prompts.append(prompt)
        vision.append(inputs)
    columns = {name: list(records[name]) for name in records.column_names if name not in RESERVED}
    return Prompts(ids, prompts, columns, list(range(len(ids))), vision if images else None)


def prompt_encoder(path: str, tokenizer: PreTrainedTokenizerBase, template: str, vision: ProcessorMixin | None,
                   tools: PromptTools | None) -> Encoder:
    """How `path`'s prompts are encoded: by `vision`, the checkpoint's processor (its chat template; image paths
    relative to the data's folder), or as text or chat through the run's template (with `tools`: each showing its
    record's tools)."""
    if vision is not None:
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        return lambda record, where: encode_image_prompt(record, vision, folder, where)

    def encode(record: dict[str, Any], where: str) -> tuple[list[int], Any, None]:
        prompt, shown = tools(record, where) if tools else (record["prompt"], None)
        return encode_prompt(prompt, tokenizer, template, where, shown), prompt, None
    return encode


def load_prompt_data(tokenizer: PreTrainedTokenizerBase, cfg: Config,
                     processor: Callable[[], ProcessorMixin] | None = None,
                     tools: PromptTools | None = None) -> PromptData:
    """The prompts, held out as text data is (data/kinds.py): data.eval_path's prompts where given, else
    data.eval_samples of them, at most a tenth (by the seed). Where the training or the held-out records show
    images, all go through `processor()`, the checkpoint's; `tools`: each record's tools, for rollouts that call
    them."""
    held_out_source = eval_source(cfg.data)
    parts = [sources_of(cfg.data)] + ([[held_out_source]] if held_out_source is not None else [])
    read = [(part[0].path, read_prompts(part, cfg.data, cfg.train.seed)) for part in parts]
    shown = processor is not None and any(prompts_have_images(records) for _, records in read)
    vision = processor() if processor is not None and shown else None
    if vision is not None and tools is not None:
        raise DataError(f"{read[0][0]}: prompts with images and grpo.tools / environments together are not built "
                        "yet; give text prompts, or leave out the tools")
    template = "processor" if vision is not None else run_template(cfg.data, tokenizer)
    encoded = [encoded_prompts(records, path, prompt_encoder(path, tokenizer, template, vision, tools),
                               cfg.prompt_room, vision is not None) for path, records in read]
    train, held_out = held_out_sets(encoded[0], encoded[1] if len(encoded) > 1 else None,
                                    lambda split, picked: split.subset(sorted(picked)), cfg.data.eval_samples,
                                    cfg.train.seed, "prompt")
    return PromptData(train, held_out, template)
