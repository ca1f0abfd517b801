"""KTO's unpaired records -> pairs the preference pipeline trains on: a record's own prompt and completion, then
its KL sequence (the same prompt with the completion of the record before it in its source, the first taking the
last's), and its label.

The records are TRL's unpaired shape: `prompt` and `completion` as strings or message lists, `label` true for a
desirable completion and false for an undesirable one (format chat; `data.fields` renames them). TRL rotates the
completions within each batch of its sequential sampler; here the rotation is over the source, fixed when it is
read, so the KL sequences do not depend on the world size, the batch or the shuffle, and can be computed ahead with
the reference.
"""

from __future__ import annotations

from typing import Any

import datasets

from qlora_fsdp.config import SourceConfig
from qlora_fsdp.data.pair_records import PAIR, BadPair, as_turns, prompt_turns
from qlora_fsdp.data.sources import ConversationMaker
from qlora_fsdp.errors import DataError

KTO_FIELDS = {"prompt": "prompt", "completion": "completion", "label": "label", "system": "system", "role": "role",
              "content": "content", "tools": "tools"}
KTO_RECORD = datasets.Features({**PAIR, "desirable": datasets.Value("bool")})


def record_label(value: Any) -> bool:
    """A record's label: a JSON boolean (TRL's), or 1/0."""
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise BadPair(f"its label is {value!r}; KTO's label is true (desirable) or false (undesirable)")


class KtoMaker:
    """One KTO record -> {prompt, chosen (its completion), rejected (filled by the rotation), desirable, ...}."""

    def __init__(self, source: SourceConfig) -> None:
        if source.format != "chat":
            raise DataError(f"KTO data is read as format chat (prompt, completion, label), not '{source.format}'")
        unknown = set(source.fields) - set(KTO_FIELDS)
        if unknown:
            raise DataError(f"data fields {sorted(unknown)} do not apply to KTO data; its fields are "
                            f"{sorted(KTO_FIELDS)}")
        self.fields = {**KTO_FIELDS, **source.fields}
        turn_fields = {"role": self.fields["role"], "content": self.fields["content"], "tools": self.fields["tools"]}
        self.turns = ConversationMaker(SourceConfig(path=source.path, format="chat", fields=turn_fields))
        self.origin = source.path
        self.version = 1  # part of the map function's hash

    def __call__(self, record: dict[str, Any], index: int) -> dict[str, Any]:
        f = self.fields
        prompt = prompt_turns(self.turns, f, record, index)
        completion = as_turns(self.turns, record.get(f["completion"]), "assistant", index)
        where = {"tools": self.turns.tools(record, index), "origin": self.origin, "record": index + 1, "margin": 0.0}
        try:
            desirable = record_label(record.get(f["label"]))
            check_record(prompt, completion)
        except BadPair as err:
            return {"prompt": [], "chosen": [], "rejected": [], "desirable": False, "problem": str(err), **where}
        return {"prompt": prompt, "chosen": completion, "rejected": [], "desirable": desirable, "problem": "",
                **where}


def check_record(prompt: list, completion: list) -> None:
    if not prompt:
        raise BadPair("it has no prompt")
    if prompt[-1]["role"] == "assistant":
        raise BadPair("the prompt ends with an assistant turn, so the completion would continue it")
    if not any(t["role"] == "assistant" and (t["content"].strip() or t["tool_calls"]) for t in completion):
        raise BadPair("the completion is empty")


def as_kto_pairs(dataset: datasets.Dataset, source: SourceConfig) -> datasets.Dataset:
    """The source's records as pairs (own sequence, KL sequence); bad records keep their place and their problem."""
    records = dataset.map(KtoMaker(source), with_indices=True, remove_columns=dataset.column_names,
                          features=KTO_RECORD, desc=f"reading KTO records from {source.path}")
    return records.map(rotated_completions, batched=True, batch_size=None, features=KTO_RECORD,
                       desc="pairing each prompt with another completion (KTO's KL sequences)")


def rotated_completions(batch: dict[str, list]) -> dict[str, list]:
    """Each record's KL completion: the completion of the usable record before it (cyclically)."""
    usable = [i for i, problem in enumerate(batch["problem"]) if not problem]
    batch["rejected"] = [[] for _ in batch["chosen"]]
    for position, index in enumerate(usable):
        batch["rejected"][index] = batch["chosen"][usable[position - 1]]
    return batch
