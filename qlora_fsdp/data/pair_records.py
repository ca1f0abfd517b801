"""Preference records -> a prompt and two completions, as conversations (the SFT reader's messages).

The shapes people write, all read per record:
- TRL's, with an explicit prompt: `prompt`, `chosen`, `rejected` as strings, or as message lists (the prompt's
  turns, then each completion's assistant turns);
- TRL's implicit prompt: `chosen` and `rejected` as whole conversations that share their opening turns;
- UltraFeedback-binarized: `prompt` a string, `chosen` and `rejected` whole conversations that repeat it;
- ShareGPT / LLaMA-Factory (format `sharegpt`): `conversations` (from/value turns), `chosen` and `rejected` single
  turns, an optional `system`.
A pair that cannot be trained on (an empty or identical completion, prompts that disagree) is reported by its
record, and refused or dropped as `preference.bad_pairs` says.
"""

from __future__ import annotations

from typing import Any

import datasets

from qlora_fsdp.config import SourceConfig
from qlora_fsdp.data.sources import CONVERSATION, ConversationMaker, Message, message
from qlora_fsdp.errors import DataError

PAIR_FIELDS = {
    "chat": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "system": "system", "role": "role",
             "content": "content", "tools": "tools", "margin": "margin"},
    "sharegpt": {"prompt": "conversations", "chosen": "chosen", "rejected": "rejected", "system": "system",
                 "role": "from", "content": "value", "tools": "tools", "margin": "margin"},
}
TURNS = CONVERSATION["messages"]
# origin and record (1-based) name the record in the messages about a pair that later steps find unusable; margin:
# a reward model's per-pair margin (TRL's `margin` column; 0 where a record has none)
PAIR = datasets.Features({"prompt": TURNS, "chosen": TURNS, "rejected": TURNS, "tools": datasets.Value("string"),
                          "problem": datasets.Value("string"), "origin": datasets.Value("string"),
                          "record": datasets.Value("int64"), "margin": datasets.Value("float64")})


class BadPair(ValueError):
    """A record that holds no trainable pair; the message says why (the caller names the record)."""


def as_turns(maker: ConversationMaker, value: Any, role: str, index: int) -> list[Message]:
    """A string (one turn of `role`), one turn, or a list of turns -> messages."""
    if isinstance(value, str):
        return [message(role, value)]
    turns: list[Message] = []
    for turn in [value] if isinstance(value, dict) else value if isinstance(value, list) else []:
        maker.add_turn(turns, turn, index)
    return turns


def shared_opening(chosen: list[Message], rejected: list[Message]) -> int:
    """How many opening turns the two conversations share."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return n


def without_prompt(turns: list[Message], prompt: list[Message], name: str) -> list[Message]:
    """A completion written as the whole conversation (UltraFeedback's): the prompt's turns taken off the front."""
    if turns[: len(prompt)] == prompt:
        return turns[len(prompt) :]
    if turns and turns[0]["role"] != "assistant":
        raise BadPair(f"the {name} conversation does not start with the record's prompt (the prompts disagree)")
    return turns


def split_pair(prompt: list[Message], chosen: list[Message], rejected: list[Message]) -> tuple[list[Message], ...]:
    """(prompt, chosen, rejected) with each completion's own turns only; BadPair where none can be trained."""
    if not prompt:  # implicit prompt: the opening the two conversations share
        n = shared_opening(chosen, rejected)
        while n and chosen[n - 1]["role"] == "assistant":  # a completion starts with the assistant's turn
            n -= 1
        if n == 0:
            raise BadPair("chosen and rejected share no opening turns and the record has no prompt")
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    else:
        chosen, rejected = without_prompt(chosen, prompt, "chosen"), without_prompt(rejected, prompt, "rejected")
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        if not any(t["role"] == "assistant" and (t["content"].strip() or t["tool_calls"]) for t in turns):
            raise BadPair(f"the {name} completion is empty")
    if chosen == rejected:
        raise BadPair("chosen and rejected are the same")
    if prompt[-1]["role"] == "assistant":
        raise BadPair("the prompt ends with an assistant turn, so the completions would continue it")
    return prompt, chosen, rejected


def pair_margin(value: Any) -> float:
    """A record's margin (a number; none: 0)."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadPair(f"its margin is {value!r}; a margin is a number")
    return float(value)


def prompt_turns(maker: ConversationMaker, fields: dict[str, str], record: dict[str, Any], index: int) -> list[Message]:
    """A record's prompt as messages, its `system` field (where the prompt has no system turn) first."""
    prompt = as_turns(maker, record.get(fields["prompt"]), "user", index)
    system = record.get(fields["system"])
    if isinstance(system, str) and system and not (prompt and prompt[0]["role"] == "system"):
        prompt = [message("system", system), *prompt]
    return prompt


class PairMaker:
    """One preference record -> {prompt, chosen, rejected, tools, problem}; `problem` is empty for a good pair."""

    def __init__(self, source: SourceConfig) -> None:
        if source.format not in PAIR_FIELDS:
            raise DataError(f"preference data is read as format chat or sharegpt, not '{source.format}'")
        unknown = set(source.fields) - set(PAIR_FIELDS[source.format])
        if unknown:
            raise DataError(f"data fields {sorted(unknown)} do not apply to preference data in format "
                            f"'{source.format}'; its fields are {sorted(PAIR_FIELDS[source.format])}")
        self.fields = {**PAIR_FIELDS[source.format], **source.fields}
        turn_fields = {"role": self.fields["role"], "content": self.fields["content"], "tools": self.fields["tools"]}
        self.turns = ConversationMaker(SourceConfig(path=source.path, format=source.format, fields=turn_fields))
        self.origin = source.path
        self.version = 1  # part of the map function's hash

    def __call__(self, record: dict[str, Any], index: int) -> dict[str, Any]:
        f = self.fields
        prompt = prompt_turns(self.turns, f, record, index)
        chosen, rejected = (as_turns(self.turns, record.get(f[name]), "assistant", index)
                            for name in ("chosen", "rejected"))
        where = {"tools": self.turns.tools(record, index), "origin": self.origin, "record": index + 1, "margin": 0.0}
        try:
            where["margin"] = pair_margin(record.get(f["margin"]))
            prompt, chosen, rejected = split_pair(prompt, chosen, rejected)
        except BadPair as err:
            return {"prompt": [], "chosen": [], "rejected": [], "problem": str(err), **where}
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "problem": "", **where}


def as_pairs(dataset: datasets.Dataset, source: SourceConfig) -> datasets.Dataset:
    maker = PairMaker(source)
    return dataset.map(maker, with_indices=True, remove_columns=dataset.column_names, features=PAIR,
                       desc=f"reading pairs from {source.path}")


def good_pairs(pairs: datasets.Dataset, drop_bad: bool) -> tuple[datasets.Dataset, int]:
    """The pairs whose `problem` is empty, and how many were dropped; the first bad one is an error (naming its file
    and record) unless `drop_bad`."""
    problems = pairs["problem"]
    bad = [index for index, problem in enumerate(problems) if problem]
    if bad and not drop_bad:
        first = pairs[bad[0]]
        raise DataError(f"{first['origin']}: record {first['record']}: {first['problem']} (or set "
                        "preference.bad_pairs: drop)")
    if not bad:
        return pairs, 0
    return pairs.select([i for i in range(len(pairs)) if not problems[i]]), len(bad)
