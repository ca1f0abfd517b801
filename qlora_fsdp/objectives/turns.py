"""Multi-turn rollouts, as TRL 1.16's GRPOTrainer runs them with tools: the model replies; the calls in its reply
are run and their results appended as tool messages (rendered by the chat template between the reply's end of
turn and the next assistant header); it replies again, until a reply without a call, or
grpo.max_tool_calling_iterations rounds, or no room is left.

A rollout's completion is everything after its prompt, in generation order: the replies (the policy's tokens:
trained on) and the tool turns between them (context: in no loss, KL, entropy or length), concatenated as ids
and never re-tokenized. max_completion_length bounds the whole completion: a round whose results would pass it is
dropped (the rollout ends on its last reply), and a reply is cut at what is left. A rollout's advantage reaches
every one of its replies.

Ranks stay in step: each round every rank says whether it has rollouts still calling, and a rank with none still
decodes (one row, thrown away) while another has, so the layouts' collectives meet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from qlora_fsdp.agents.call_formats import CallFormat, parse_reply
from qlora_fsdp.agents.environments import EnvironmentPool, environment_of, reset, tools_of
from qlora_fsdp.agents.recipe import rollout_tools
from qlora_fsdp.agents.toolbox import run_call
from qlora_fsdp.config import GrpoConfig, Template
from qlora_fsdp.data.prompts import Prompts
from qlora_fsdp.data.templates import prompt_ids
from qlora_fsdp.distributed import all_reduce_sums
from qlora_fsdp.errors import DataError
from qlora_fsdp.objectives.rollouts import Decoder
from qlora_fsdp.objectives.tool_templates import tool_call_format, tool_turn_ids


@dataclass
class Rollout:
    """One row's rollout: its completion ids, which of them are the policy's, and its messages."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    policy: list[int] = field(default_factory=list)  # 1: a token the policy generated, 0: a tool turn's
    messages: list[dict[str, Any]] = field(default_factory=list)  # the replies and tool messages, in order
    truncated: bool = False  # the last reply ran out of room without an end
    calls: list[dict[str, Any]] = field(default_factory=list)  # the last reply's calls, not yet run

    @property
    def room(self) -> int:
        return len(self.ids)

    def reply(self, ids: list[int], truncated: bool, message: dict[str, Any] | None) -> None:
        self.ids += ids
        self.policy += [1] * len(ids)
        self.truncated = truncated
        if message is not None:
            self.messages.append(message)
        self.calls = list(message.get("tool_calls", [])) if message else []


@dataclass
class ToolCounts:
    calls: int = 0
    failures: int = 0
    malformed: int = 0


@dataclass
class Turns:
    """What a step's rollouts need besides the decoder: how replies are read and tool turns written."""

    tokenizer: PreTrainedTokenizerBase
    template: Template
    form: CallFormat
    grpo: GrpoConfig
    completion_tokens: int  # generation.max_completion_length: a rollout's replies and tool turns together
    max_positions: int  # the model's: a rollout's context stays below it (TRL's check)
    device: torch.device

    def read(self, ids: list[int], counts: ToolCounts) -> dict[str, Any]:
        text = str(self.tokenizer.decode(ids, skip_special_tokens=False))
        ends = [t for t in {self.tokenizer.eos_token, self.tokenizer.pad_token} if t]
        reply = parse_reply(text, self.form, ends)
        counts.malformed += reply.malformed
        return reply.message

    def run_round(self, rollout: Rollout, tools: dict[str, Callable[..., Any]], counts: ToolCounts) -> list[int] | None:
        """The rollout's pending calls run; their results' tokens, or None (nothing added) where they would pass
        max_completion_length or the model's positions."""
        results = [run_call(tools, call, self.grpo.tool_timeout_s) for call in rollout.calls]
        counts.calls += len(results)
        counts.failures += sum(result.failed for result in results)
        messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        suffix = tool_turn_ids(messages, self.tokenizer, self.template)
        used = rollout.room + len(suffix)
        if used > self.completion_tokens or len(rollout.prompt) + used >= self.max_positions:
            return None
        rollout.messages += messages
        rollout.ids += suffix
        rollout.policy += [0] * len(suffix)
        return suffix

    def any_rank(self, count: int) -> bool:
        return all_reduce_sums([float(count)], self.device)[0] > 0


def run_rollouts(decode: Decoder, turns: Turns, prompts: list[list[int]],
                 tools: list[dict[str, Callable[..., Any]]]) -> tuple[list[Rollout], ToolCounts]:
    """Each prompt row's whole rollout (`tools[i]`: what row i may call). A collective: every rank calls it."""
    counts = ToolCounts()
    rollouts = [Rollout(list(prompt)) for prompt in prompts]
    first = decode(prompts)
    for rollout, ids, cut in zip(rollouts, first.ids, first.truncated, strict=True):
        rollout.reply(ids, cut, turns.read(ids, counts))
    limit = turns.grpo.max_tool_calling_iterations
    rounds = 0
    while limit is None or rounds < limit:
        calling = [i for i, r in enumerate(rollouts) if r.calls]
        kept = [i for i in calling if turns.run_round(rollouts[i], tools[i], counts) is not None]
        for i in set(calling) - set(kept):
            rollouts[i].calls = []
        if not turns.any_rank(len(kept)):
            break
        budgets = {i: turns.completion_tokens - rollouts[i].room for i in kept}
        going = [i for i in kept if budgets[i] > 0]
        for i in set(kept) - set(going):  # no room left for a reply: it ends on the tool turn, cut
            rollouts[i].reply([], True, None)
        rows = [rollouts[i].prompt + rollouts[i].ids for i in going]
        made = decode(rows or [prompts[0]], [budgets[i] for i in going] or [1])  # an idle rank decodes a dummy row
        for i, ids, cut in zip(going, made.ids, made.truncated, strict=False):
            rollouts[i].reply(ids, cut, turns.read(ids, counts) if ids else None)
        rounds += 1
    return rollouts, counts


@dataclass
class Made:
    """A step's rows (num_generations a prompt, in order): each row's prompt ids and completion, and what the
    reward functions see of it."""

    prompts: list[list[int]]
    ids: list[list[int]]
    truncated: list[bool]
    policy: list[list[int]] | None = None  # per completion token: 1 the policy's, 0 a tool turn's
    messages: list[list[dict[str, Any]]] | None = None  # the replies and tool messages (reward functions' completions)
    reward_prompts: list[Any] | None = None  # the prompts with an environment's reset text appended
    environments: list[Any] | None = None  # each row's environment instance
    counts: ToolCounts | None = None

    @property
    def lengths(self) -> list[int]:
        """The policy's tokens of each completion (tool turns left out, as TRL counts them)."""
        return [sum(mask) for mask in self.policy] if self.policy is not None else [len(i) for i in self.ids]


def with_observation(prompt: list[dict[str, Any]], observation: Any, where: str) -> list[dict[str, Any]]:
    """The prompt with reset()'s text appended to its last message, as TRL appends it (a new message list)."""
    if not isinstance(observation, str):
        raise DataError(f"{where}: the environment's reset returned {type(observation).__name__}; return None or "
                        "text (images from an environment are not built yet)")
    return [*prompt[:-1], {**prompt[-1], "content": str(prompt[-1]["content"]) + observation}]


class ToolRollouts:
    """A run's multi-turn rollouts: its tools, its environments' instances, and how its template reads calls."""

    def __init__(self, grpo: GrpoConfig, tokenizer: PreTrainedTokenizerBase, template: Template, max_positions: int,
                 prompt_room: int, completion_tokens: int, device: torch.device) -> None:
        self.tooling = rollout_tools(grpo)
        self.pool = EnvironmentPool(self.tooling.environments)
        self.turns = Turns(tokenizer, template, tool_call_format(tokenizer, template), grpo, completion_tokens,
                           max_positions, device)
        self.prompt_room = prompt_room

    def row_prompt(self, prompts: Prompts, index: int, environment: Any, name: str | None) -> tuple[list[int], Any]:
        """A row's prompt ids and messages: the data's, or re-rendered with what its environment's reset said."""
        where = f"prompt {prompts.records[index] + 1} of the dataset"
        record = {"prompt": prompts.prompts[index], **{k: v[index] for k, v in prompts.columns.items()}}
        if environment is None:
            return prompts.ids[index], record["prompt"]
        arguments = {k: v for k, v in record.items() if k != "environment"} if name is not None else record
        observation = reset(environment, arguments, where)
        if observation is None:
            return prompts.ids[index], record["prompt"]
        messages = with_observation(record["prompt"], observation, where)
        ids = prompt_ids(messages, self.turns.tokenizer, self.turns.template, self.tooling.schemas(name))
        if len(ids) > self.prompt_room:
            raise DataError(f"{where}: with its environment's reset text the prompt has {len(ids)} tokens, more than "
                            f"data.context_length - generation.max_completion_length = {self.prompt_room}")
        return ids, messages

    def make(self, decode: Decoder, prompts: Prompts, generations: int) -> Made:
        """Every prompt's `generations` rollouts. A collective: every rank calls it."""
        rows = [p for p in range(len(prompts)) for _ in range(generations)]
        kinds = self.tooling.environments
        names = [environment_of({k: v[p] for k, v in prompts.columns.items()}, kinds,
                                f"prompt {prompts.records[p] + 1} of the dataset") for p in rows]
        environments = self.pool.instances(names) if kinds else [None] * len(rows)
        started = [self.row_prompt(prompts, p, env, name) for p, env, name in zip(rows, environments, names,
                                                                                   strict=True)]
        tools = [tools_of(env, self.tooling.tools) for env in environments]
        done, counts = run_rollouts(decode, self.turns, [ids for ids, _ in started], tools)
        return Made([r.prompt for r in done], [r.ids for r in done], [r.truncated for r in done],
                    [r.policy for r in done], [r.messages for r in done], [messages for _, messages in started],
                    environments if kinds else None, counts)
