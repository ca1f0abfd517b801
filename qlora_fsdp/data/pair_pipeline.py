"""Preference data: sources -> pairs (a prompt, a chosen and a rejected completion) -> token sequences that fit the
context -> train and held-out pairs, tokenized through `datasets.map` (cached like SFT's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from qlora_fsdp.config import Config, OverlongPolicy, SourceConfig, Template
from qlora_fsdp.data.fingerprint import map_fingerprint
from qlora_fsdp.data.kto_records import as_kto_pairs
from qlora_fsdp.data.pair_encoding import EncodedPair, encode_pair, fit_pair
from qlora_fsdp.data.pair_records import BadPair, as_pairs, good_pairs
from qlora_fsdp.data.pipeline import PAIR_EXTRAS, Dataset, assembled
from qlora_fsdp.data.sources import read_source, weighted
from qlora_fsdp.distributed import DistInfo

PAIR_COLUMNS = ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels", "length")


@dataclass(frozen=True)
class PairOutcome:
    """One pair record as training reads it (the studio's preview calls the same): its sequences, the two fitted to
    the context (None: not kept), and why it is a bad pair ("" where it is not)."""

    encoded: EncodedPair | None
    fitted: EncodedPair | None
    problem: str


class TokenizePair:
    """A picklable, hashable map function: a pair -> its two sequences fitted to the context, or nothing."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: Template, context_length: int,
                 overlong: OverlongPolicy) -> None:
        self.tokenizer, self.template = tokenizer, template
        self.context_length, self.overlong = context_length, overlong

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list[Any]] = {name: [] for name in (*PAIR_COLUMNS, "overlong", "problem", "origin", "record")}
        out["origin"], out["record"] = batch["origin"], batch["record"]
        kto = "desirable" in batch  # a record and its KL sequence, which may be the same
        for column in PAIR_EXTRAS:
            if column in batch:
                out[column] = batch[column]
        for prompt, chosen, rejected, tools in zip(batch["prompt"], batch["chosen"], batch["rejected"],
                                                   batch["tools"], strict=True):
            outcome = self.outcome(prompt, chosen, rejected, tools, kto)
            encoded, fitted = outcome.encoded, outcome.fitted
            out["problem"].append(outcome.problem)
            out["overlong"].append(encoded is not None and encoded.length > self.context_length)
            for name, value in (("chosen_ids", fitted.chosen.input_ids if fitted else []),
                                ("chosen_labels", fitted.chosen.labels if fitted else []),
                                ("rejected_ids", fitted.rejected.input_ids if fitted else []),
                                ("rejected_labels", fitted.rejected.labels if fitted else []),
                                ("length", fitted.length if fitted else 0)):
                out[name].append(value)
        return out

    def outcome(self, prompt: Any, chosen: Any, rejected: Any, tools: Any, kto: bool,
                read_problem: str = "") -> PairOutcome:
        """A pair's record encoded and fitted; `read_problem`: what reading it found wrong already."""
        try:
            if read_problem:
                raise BadPair(read_problem)
            encoded = encode_pair(prompt, chosen, rejected, tools, self.tokenizer, self.template, kto)
        except BadPair as err:
            return PairOutcome(None, None, str(err))
        fitted = fit_pair(encoded, self.context_length, self.overlong)
        return PairOutcome(encoded, fitted, self.cut_to_nothing(encoded) if fitted is None else "")

    def cut_to_nothing(self, pair: EncodedPair) -> str:
        """Why a pair that did not fit is bad, or "" where the recipe chose to drop what is longer (overlong: drop)."""
        if self.overlong == "drop":
            return ""
        return (f"its prompt's {pair.prompt_tokens} tokens leave no room for both completions in "
                f"data.context_length {self.context_length}; raise data.context_length")


def read_pairs(sources: list[SourceConfig], seed: int, cache_dir: str | None, drop_bad: bool,
               kto: bool = False) -> tuple[datasets.Dataset, int, int]:
    """(good pairs of every source, mixed by weight; records read; bad records dropped). `kto`: unpaired records,
    each a pair of its own sequence and its KL sequence."""
    parts, n_records, n_bad = [], 0, 0
    for source in sources:
        records = read_source(source, cache_dir)
        pairs, dropped = good_pairs((as_kto_pairs if kto else as_pairs)(records, source), drop_bad)
        parts.append(weighted(pairs, source.weight, seed))
        n_records, n_bad = n_records + len(records), n_bad + dropped
    return (datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]), n_records, n_bad


def tokenized_pairs(sources: list[SourceConfig], tokenizer: PreTrainedTokenizerBase, cfg: Config,
                    template: Template) -> tuple[datasets.Dataset, int, int, int]:
    """(pairs that fit the context, records read, pairs longer than the context, pairs dropped)."""
    data = cfg.data
    drop_bad = cfg.preference.bad_pairs == "drop"
    pairs, n_records, n_bad = read_pairs(sources, cfg.train.seed, data.cache_dir, drop_bad,
                                         cfg.train.kind.unpaired)
    encoded = pairs.map(TokenizePair(tokenizer, template, data.context_length, data.overlong), batched=True,
                        remove_columns=pairs.column_names, num_proc=data.num_proc if data.num_proc > 1 else None,
                        desc="tokenizing pairs",
                        new_fingerprint=map_fingerprint(pairs._fingerprint, tokenizer, "TokenizePair", template,
                                                        data.context_length, data.overlong))
    n_overlong = sum(encoded["overlong"])
    # a completion with no target token under the template, a prompt that leaves the completions no room
    encoded, n_unusable = good_pairs(encoded, drop_bad)
    kept = encoded.filter(lambda length: length > 0, input_columns="length", desc="fitting pairs")
    kept = kept.remove_columns(["overlong", "problem", "origin", "record"])
    return kept, n_records, n_overlong, n_bad + n_unusable + len(encoded) - len(kept)


def load_pairs(tokenizer: PreTrainedTokenizerBase, cfg: Config, info: DistInfo | None = None) -> Dataset:
    """Read, tokenize and split the recipe's preference data; the held-out pairs are chosen by the seed."""
    return assembled(cfg.data, tokenizer, cfg.train.seed, info, "pairs",
                     lambda sources, template: tokenized_pairs(sources, tokenizer, cfg, template))
