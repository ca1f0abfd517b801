"""The data pipeline: sources -> conversations -> token ids and labels -> train and held-out sets.

Tokenization runs through `datasets.map`, so its result is cached under a fingerprint of the data, the
tokenizer and the settings; the first process of each node tokenizes, the others then read its cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from qlora_fsdp.config import DataConfig, OverlongPolicy, SourceConfig, Template
from qlora_fsdp.data.batching import Sample, pack
from qlora_fsdp.data.fingerprint import map_fingerprint
from qlora_fsdp.data.kinds import TrainingData, held_out_sets
from qlora_fsdp.data.sources import eval_source, mixed_conversations, sources_of
from qlora_fsdp.data.templates import IGNORE_INDEX, choose_template, encode
from qlora_fsdp.distributed import DistInfo, main_process_first
from qlora_fsdp.errors import DataError

PAIR_EXTRAS = ("desirable", "margin")  # a pair's columns beside its sequences, carried to its batch
TokenizedData = TrainingData[datasets.Dataset]  # what an objective reading SFT samples or pairs sees: a Dataset


@dataclass
class Dataset:
    train: datasets.Dataset  # columns: input_ids, labels, length
    eval: datasets.Dataset
    template: Template
    n_records: int
    n_overlong: int  # longer than context_length (then truncated, dropped or split as the recipe says)
    n_without_targets: int  # dropped: nothing left to learn from (e.g. a prompt filling the context)
    packs: list[list[int]] | None = None  # with packing: the sample indices of each row
    has_images = False  # records with images load as data/images.py's ImageData (not a field: no annotation)

    @property
    def pairs(self) -> bool:
        """Preference pairs (qlora_fsdp/data/pair_pipeline.py) rather than SFT samples."""
        return "chosen_ids" in self.train.column_names

    def samples(self, split: datasets.Dataset, indices: list[int]) -> list[Sample]:
        """The samples at `indices`; for pairs, each pair's chosen then its rejected sequence."""
        if "chosen_ids" in split.column_names:
            rows = split[indices] if indices else dict.fromkeys(split.column_names, [])
            return [sample for c_ids, c_labels, r_ids, r_labels in zip(
                        rows["chosen_ids"], rows["chosen_labels"], rows["rejected_ids"], rows["rejected_labels"],
                        strict=True)
                    for sample in (Sample(c_ids, c_labels), Sample(r_ids, r_labels))]
        rows = split[indices] if indices else {"input_ids": [], "labels": []}
        return [Sample(ids, labels) for ids, labels in zip(rows["input_ids"], rows["labels"], strict=True)]

    @staticmethod
    def pair_extras(split: datasets.Dataset) -> dict[str, list]:
        """What a pair carries besides its sequences, by column (PAIR_EXTRAS): KTO's label, a reward model's
        margin."""
        return {column: split[column] for column in PAIR_EXTRAS if column in split.column_names}

    @property
    def n_units(self) -> int:
        return len(self.packs) if self.packs is not None else len(self.train)

    def unit_lengths(self) -> list[int]:
        lengths = self.train["length"]
        return [sum(lengths[i] for i in row) for row in self.packs] if self.packs is not None else lengths

    def describe(self, context_length: int, overlong: OverlongPolicy) -> str:
        rows = f", packed into {len(self.packs)} rows" if self.packs is not None else ""
        unit = "pairs" if self.pairs else "samples"
        why = "as bad pairs or without room (preference.bad_pairs)" if self.pairs else "with no target tokens"
        return (f"{self.n_records} records, {len(self.train)} train / {len(self.eval)} eval {unit}{rows} "
                f"(template {self.template}); {self.n_overlong} longer than {context_length} tokens ({overlong}); "
                f"{self.n_without_targets} dropped {why}")


class Tokenize:
    """A picklable, hashable map function: conversation -> input_ids, labels, length."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: Template, train_on_inputs: bool) -> None:
        self.tokenizer, self.template, self.train_on_inputs = tokenizer, template, train_on_inputs

    def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        # tools passed positionally; a conversations cache from before tool support has no tools column
        ids, labels = encode(record["messages"], self.tokenizer, self.template, self.train_on_inputs,
                             record.get("tools") or "")
        return {"input_ids": ids, "labels": labels, "length": len(ids)}


def fit_to_context(batch: dict[str, list], indices: list[int], context_length: int, policy: str) -> dict[str, list]:
    """Batched map: truncate, drop or split samples longer than the context; drop any with no target."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "record": []}
    for ids, labels, record in zip(batch["input_ids"], batch["labels"], indices, strict=True):
        if len(ids) > context_length and policy == "drop":
            continue
        starts = range(0, len(ids), context_length) if policy == "split" else [0]
        for start in starts:
            piece_ids, piece_labels = ids[start : start + context_length], labels[start : start + context_length]
            if any(label != IGNORE_INDEX for label in piece_labels[1:]):  # the first token is never a target
                out["input_ids"].append(piece_ids)
                out["labels"].append(piece_labels)
                out["length"].append(len(piece_ids))
                out["record"].append(record)
    return out


def tokenized(sources: list[SourceConfig], tokenizer: PreTrainedTokenizerBase, data: DataConfig, template: Template,
              seed: int) -> tuple[datasets.Dataset, int, int, int]:
    """(samples that fit the context, records read, records longer than the context, records with no target)."""
    conversations = mixed_conversations(sources, seed, data.cache_dir)
    encoded = conversations.map(Tokenize(tokenizer, template, data.train_on_inputs),
                                remove_columns=conversations.column_names,  # messages, tools
                                num_proc=data.num_proc if data.num_proc > 1 else None, desc="tokenizing",
                                new_fingerprint=map_fingerprint(conversations._fingerprint, tokenizer, "Tokenize",
                                                                template, data.train_on_inputs))
    n_overlong = sum(length > data.context_length for length in encoded["length"])
    fitted = encoded.map(fit_to_context, batched=True, with_indices=True, desc="fitting",
                         fn_kwargs={"context_length": data.context_length, "policy": data.overlong})
    n_dropped = n_overlong if data.overlong == "drop" else 0
    kept = set(fitted["record"]) if "record" in fitted.column_names else set()  # an empty result has no columns
    n_without_targets = len(conversations) - n_dropped - len(kept)
    return fitted, len(conversations), n_overlong, n_without_targets


def run_template(data: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Template:
    """The template a run trains with, and its tools prompt with: from the first source's format (`data.sources`
    or the single `data.path`), so training and generation can never choose differently."""
    return choose_template(data.template, tokenizer, sources_of(data)[0].format)


# (sources, template) -> (what fits the context, records read, longer than the context, dropped)
Tokenizer = Callable[[list[SourceConfig], Template], tuple[datasets.Dataset, int, int, int]]


def load_dataset(tokenizer: PreTrainedTokenizerBase, data: DataConfig, seed: int,
                 info: DistInfo | None = None) -> Dataset:
    """Read, tokenize and split the recipe's data; the held-out set is chosen by the seed."""
    return assembled(data, tokenizer, seed, info, "samples",
                     lambda sources, template: tokenized(sources, tokenizer, data, template, seed))


def assembled(data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int, info: DistInfo | None, unit: str,
              tokenize: Tokenizer) -> Dataset:
    """The outline SFT samples and preference pairs share: the template, `tokenize` on the node's first process
    (the others read its cache), the held-out split by the seed, and the packed rows."""
    sources = sources_of(data)
    if info is not None and info.rank != 0:
        datasets.disable_progress_bars()  # one set of bars per run, from rank 0
    template = run_template(data, tokenizer)
    with main_process_first(info):
        samples, n_records, n_overlong, n_dropped = tokenize(sources, template)
        held_out_source = eval_source(data)
        held_out = tokenize([held_out_source], template)[0] if held_out_source is not None else None
    if not len(samples):
        raise DataError(f"no trainable {unit} in {', '.join(s.path for s in sources)} after fitting to "
                        f"{data.context_length} tokens ({n_overlong} longer, overlong={data.overlong})")
    train, eval_set = held_out_sets(samples, held_out, lambda split, picked: split.select(picked), data.eval_samples,
                                    seed, unit[:-1])
    packs = pack(train["length"], data.context_length) if data.packing else None
    return Dataset(train, eval_set, template, n_records, n_overlong, n_dropped, packs)
