"""GRPO's decoding loop for the fused kernels: the prompt's forward, then replays of `STEPS_PER_REPLAY` decoding
steps, each step the model's forward on the last tokens, transformers' logits processors and warpers, the sampled
token and its log-probability written into preallocated buffers, all on the device.

transformers' `generate` samples between graph replays on the host and asks the GPU every step whether every row
has stopped. Here a replay holds several whole steps, sampling included (torch.compile in reduce-overhead mode
records it as one CUDA graph on a GPU; a CPU runs the same steps eagerly), the step's counter and the rows'
positions live on the device, and the stop check is asynchronous: after each replay the "every row has ended"
flag is copied to the host without waiting, and the host reads the previous replay's flag while the next one runs.
A finished call thus runs at most one replay too many, whose tokens are padding, as transformers writes them.

The same tokens as `generate` (greedy; sampled from the same seed, a call at a time): positions from the mask's
cumulative sum, the processors in transformers' order (suppression, then the recorder's log-probabilities of the
raw logits at the temperature, then temperature, top-k, top-p), a finished row's token the padding id. Sampling
draws as torch.multinomial does for one sample (an exponential variate per logit, the largest ratio wins), so a
CPU's stream is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from transformers import (
    LogitsProcessorList,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

STEPS_PER_REPLAY = 8


@dataclass(frozen=True)
class Sampling:
    greedy: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    suppress: tuple[int, ...] = ()
    record: bool = True  # each token's log-probability (a full pass over the logits a step)


def warpers(sampling: Sampling) -> tuple[LogitsProcessorList, LogitsProcessorList]:
    """(what comes before the recorder, what comes after it), as `generate` orders them."""
    before = LogitsProcessorList()
    if sampling.suppress:
        before.append(SuppressTokensLogitsProcessor(list(sampling.suppress)))
    after = LogitsProcessorList()
    if not sampling.greedy:
        if sampling.temperature != 1.0:
            after.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k:
            after.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
        if sampling.top_p is not None and sampling.top_p < 1.0:
            after.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
    return before, after


def sampled(scores: torch.Tensor, greedy: bool) -> torch.Tensor:
    """The next token of each row: the likeliest, or drawn as torch.multinomial draws one sample (exponential
    variates, the largest probability-to-variate ratio), with no host synchronization."""
    if greedy:
        return scores.argmax(dim=-1)
    probs = torch.softmax(scores, dim=-1)
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1)


@dataclass
class LoopState:
    """One call's device tensors: every row's tokens (prompt, then new), the mask of filled slots (as generate's),
    the positions of the next input, the log-probabilities, which rows go on, the step counter. Their shapes
    depend on the rows and the cache's length only, so calls of one cache bucket share one compiled replay."""

    sequences: torch.Tensor
    mask: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    logps: torch.Tensor
    unfinished: torch.Tensor
    column: torch.Tensor  # where the next new token goes (the prompt's width, then one more each step)
    step: torch.Tensor  # the next new token's index
    ends: torch.Tensor
    pad: torch.Tensor


def loop_state(input_ids: torch.Tensor, mask: torch.Tensor, slots: int, new: int, ends: list[int],
               pad_id: int) -> LoopState:
    rows, prompt = input_ids.shape
    device = input_ids.device
    sequences = torch.cat([input_ids, input_ids.new_full((rows, slots - prompt), pad_id)], dim=1)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, -1:].clone()
    return LoopState(sequences, torch.cat([mask, mask.new_zeros(rows, slots - prompt)], dim=1),
                     input_ids[:, -1:].clone(), positions, torch.zeros(rows, new, device=device),
                     torch.ones(rows, dtype=torch.bool, device=device), torch.tensor(prompt, device=device),
                     torch.zeros((), dtype=torch.long, device=device), torch.tensor(ends, device=device),
                     torch.tensor(pad_id, device=device))


def choose(state: LoopState, logits: torch.Tensor, sampling: Sampling, before: LogitsProcessorList,
           after: LogitsProcessorList) -> None:
    """Sample from the last position's logits; write the token (padding for a finished row), its log-probability
    at the temperature and the mask; advance the step and each row's position."""
    seen = cast(torch.LongTensor, state.sequences)
    scores = before(seen, cast(torch.FloatTensor, logits.float()))
    if sampling.record:
        record = torch.log_softmax(scores / (1.0 if sampling.greedy else sampling.temperature), dim=-1)
    scores = after(seen, scores)
    token = torch.where(state.unfinished, sampled(scores, sampling.greedy), state.pad)
    state.sequences.index_copy_(1, state.column.reshape(1), token[:, None])
    state.mask.index_fill_(1, state.column.reshape(1), 1)
    if sampling.record:
        state.logps.index_copy_(1, state.step.reshape(1), record.gather(1, token[:, None]))
    state.unfinished &= ~torch.isin(token, state.ends)
    state.tokens.copy_(token[:, None])
    state.positions += 1
    state.column += 1
    state.step += 1


def decode_steps(model: nn.Module, cache: Any, state: LoopState, sampling: Sampling, before: LogitsProcessorList,
                 after: LogitsProcessorList, count: int) -> None:
    """`count` decoding steps, nothing read back to the host: what one replay records."""
    for _ in range(count):
        out = model(input_ids=state.tokens, attention_mask=state.mask, position_ids=state.positions,
                    past_key_values=cache, use_cache=True)
        choose(state, out.logits[:, -1], sampling, before, after)


def prefill(model: nn.Module, cache: Any, state: LoopState, input_ids: torch.Tensor, mask: torch.Tensor,
            sampling: Sampling, before: LogitsProcessorList, after: LogitsProcessorList) -> None:
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    choose(state, out.logits[:, -1], sampling, before, after)


def run_loop(model: nn.Module, cache: Any, input_ids: torch.Tensor, mask: torch.Tensor, new: int, ends: list[int],
             pad_id: int, sampling: Sampling, replay: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One call: the prompt's forward, then replays until every row has ended (read one replay late on a GPU) or
    `new` tokens are made. `replay`: decode_steps compiled (a CUDA graph), else run eagerly. Returns the new tokens
    and their log-probabilities, cut to the steps taken."""
    slots = int(cache.max_cache_len) if hasattr(cache, "max_cache_len") else input_ids.shape[1] + new
    state = loop_state(input_ids, mask, slots, new, ends, pad_id)
    before, after = warpers(sampling)
    prefill(model, cache, state, input_ids, mask, sampling, before, after)
    taken, pending = 1, None
    flag = torch.zeros((), dtype=torch.bool, pin_memory=input_ids.is_cuda)
    while taken < new:
        if pending is not None:  # the previous replay's flag: it ended while this one was queued
            pending.synchronize()
            if bool(flag):
                break
        elif not bool(state.unfinished.any()):  # on a CPU, or after the prompt's forward: read at once
            break
        count = min(STEPS_PER_REPLAY, new - taken)
        (replay or decode_steps)(model, cache, state, sampling, before, after, count)
        taken += count
        if input_ids.is_cuda:
            flag.copy_(~state.unfinished.any(), non_blocking=True)
            pending = torch.cuda.Event()
            pending.record()
    width = input_ids.shape[1]
    return state.sequences[:, width : width + taken], state.logps[:, :taken]


COMPILED: dict[Any, Any] = {}  # the replay, compiled once a process for each compiler backend


def loop_generate(model: nn.Module, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                  eos_token_id: list[int], pad_token_id: int, do_sample: bool, temperature: float | None,
                  top_k: int | None, top_p: float | None, past_key_values: Any,
                  logits_processor: list[Any] | None = None, suppress_tokens: list[int] | None = None,
                  compile_config: Any = None, **_: Any) -> torch.Tensor:
    """`generate`'s call as this loop runs it (the arguments GRPO's decoder gives `generate`): the prompts and
    their new tokens; a recorder among `logits_processor` (one with `load`) receives the log-probabilities."""
    recorders = [processor for processor in logits_processor or [] if hasattr(processor, "load")]
    sampling = Sampling(not do_sample, temperature or 1.0, top_k, top_p, tuple(suppress_tokens or ()),
                        bool(recorders))
    replay = None
    if compile_config is not None:
        backend = compile_config.backend
        if backend not in COMPILED:
            COMPILED[backend] = torch.compile(decode_steps, mode="reduce-overhead", backend=backend)
        replay = COMPILED[backend]
    new, logps = run_loop(model, past_key_values, input_ids, attention_mask, max_new_tokens, eos_token_id,
                          pad_token_id, sampling, replay)
    for recorder in recorders:
        recorder.load(logps)
    return torch.cat([input_ids, new], dim=1)
