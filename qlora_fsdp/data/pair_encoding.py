"""A preference pair -> two token sequences (prompt + chosen, prompt + rejected), targets on the completions only.

Each completion is rendered with its prompt through SFT's own encoder (the recipe's template, the tokenizer's chat
template included), so a completion's target tokens are located exactly as in SFT. The prompt is the tokens the two
renderings share: their common prefix, less any completion tokens the two happen to start with (targets in both).
Targets inside the prompt (an earlier assistant turn of a multi-turn prompt) are context here, not targets.

Both sequences of a pair always go into the same row, one after the other with attention kept within each, so a
pair is never split between micro-batches or ranks; `context_length` bounds the pair (both sequences).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from qlora_fsdp.config import OverlongPolicy, Template
from qlora_fsdp.data.batching import Sample
from qlora_fsdp.data.pair_records import BadPair
from qlora_fsdp.data.templates import encode
from qlora_fsdp.data.tool_calls import Message
from qlora_fsdp.labels import IGNORE_INDEX


@dataclass(frozen=True)
class EncodedPair:
    chosen: Sample
    rejected: Sample
    prompt_tokens: int

    @property
    def length(self) -> int:
        return len(self.chosen.input_ids) + len(self.rejected.input_ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def prompt_length(chosen: Sample, rejected: Sample, same_allowed: bool = False) -> int:
    """Where the completions start: the shared tokens, less the trailing run of targets they share. `same_allowed`:
    two equal sequences are no error (a KTO record whose KL completion happens to be its own)."""
    start = common_prefix(chosen.input_ids, rejected.input_ids)
    if start == len(chosen.input_ids) == len(rejected.input_ids):
        if not same_allowed:
            raise BadPair("chosen and rejected render to the same tokens")
        while start and chosen.labels[start - 1] == IGNORE_INDEX:  # the template's tail after the last target
            start -= 1
    while start and chosen.labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start


def completion_only(sample: Sample, start: int) -> Sample:
    return Sample(sample.input_ids, [IGNORE_INDEX] * start + sample.labels[start:])


def encode_pair(prompt: list[Message], chosen: list[Message], rejected: list[Message], tools: str,
                tokenizer: PreTrainedTokenizerBase, template: Template, same_allowed: bool = False) -> EncodedPair:
    """The pair's two sequences; BadPair where a completion has no target token."""
    encoded = [Sample(*encode(prompt + completion, tokenizer, template, False, tools))
               for completion in (chosen, rejected)]
    start = prompt_length(encoded[0], encoded[1], same_allowed=same_allowed)
    pair = EncodedPair(completion_only(encoded[0], start), completion_only(encoded[1], start), prompt_tokens=start)
    for name, sample in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        if all(label == IGNORE_INDEX for label in sample.labels):
            raise BadPair(f"the {name} completion has no target tokens under the template")
    return pair


def truncated(sample: Sample, length: int) -> Sample:
    return Sample(sample.input_ids[:length], sample.labels[:length])


def fit_pair(pair: EncodedPair, context_length: int, policy: OverlongPolicy) -> EncodedPair | None:
    """The pair within `context_length` tokens, or None (dropped): `drop` drops a pair that does not fit,
    `truncate` shortens the longer completion first (the prompt is kept whole: a completion without its prompt is
    not the pair the data holds); a pair whose prompt leaves no room for a token of each completion is dropped."""
    if pair.length <= context_length:
        return pair
    prompt = pair.prompt_tokens
    budget = context_length - 2 * prompt  # completion tokens that fit, both together
    if policy != "truncate" or budget < 2:
        return None
    chosen, rejected = (len(s.input_ids) - prompt for s in (pair.chosen, pair.rejected))
    keep_chosen = min(chosen, max(budget - rejected, budget // 2))
    keep_rejected = min(rejected, budget - keep_chosen)
    return EncodedPair(truncated(pair.chosen, prompt + keep_chosen), truncated(pair.rejected, prompt + keep_rejected),
                       prompt)
