"""What a GRPO step keeps of its completions: the generation the update reads, the rewards' statistics over every
rank, and a sample of them for completions.jsonl."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from qlora_fsdp.data.batching import Sample
from qlora_fsdp.data.prompts import Prompts, is_chat
from qlora_fsdp.distributed import DistInfo, all_reduce_maxes, all_reduce_sums
from qlora_fsdp.labels import IGNORE_INDEX
from qlora_fsdp.losses.policy import StepCounts, std_from_sums
from qlora_fsdp.objectives.turns import Made
from qlora_fsdp.rewards.functions import Rollouts


@dataclass
class Generation:
    """One rank's completions for a step, ready for the update: per completion, in prompt order."""

    samples: list[Sample]
    micro_batches: list[list[int]]  # completion indices of each micro-batch
    advantages: torch.Tensor
    old_logps: list[torch.Tensor] | None
    ref_logps: list[torch.Tensor] | None
    counts: StepCounts
    metrics: dict[str, float]
    sample: dict[str, Any] | None = None  # a few completions with their rewards, for completions.jsonl


def completion_sample(prompt: list[int], completion: list[int], masked: bool, policy: list[int] | None = None,
                      vision: dict[str, torch.Tensor] | None = None) -> Sample:
    """Prompt + completion; the completion's tokens are the targets (none where its loss is masked; only the
    policy's own where a rollout called tools: `policy` marks them); `vision`: the prompt's images."""
    keep = policy if policy is not None else [1] * len(completion)
    targets = [token if kept and not masked else IGNORE_INDEX for token, kept in zip(completion, keep, strict=True)]
    return Sample(prompt + completion, [IGNORE_INDEX] * len(prompt) + targets, vision)


def reward_metrics(names: list[str], scores: torch.Tensor, rewards: torch.Tensor, made: Made, seconds: float,
                   info: DistInfo, counted: int = 1, rows: int | None = None) -> dict[str, float]:
    """Over every rank's completions (`counted` 0: a split's other ranks, whose are its first's; `rows`: the first
    that many only, an evaluation's padding after them): the reward's and each function's (`names`, the columns of
    `scores`) mean and standard deviation, the completions' mean and longest length (the policy's tokens), the
    truncated share, generated tokens a second, and with tools TRL's call and failure frequencies (of every row)."""
    kept = slice(rows)
    columns = [("reward", rewards[kept])] + [(f"rewards/{name}", scores[kept, i]) for i, name in enumerate(names)]
    lengths = made.lengths[kept]
    sums: list[float] = [sum(lengths) * counted, sum(made.truncated[kept]) * counted, len(lengths) * counted, seconds]
    for _, values in columns:
        present = values[~torch.isnan(values)].double()
        sums += [present.numel() * counted, present.sum().item() * counted, (present**2).sum().item() * counted]
    totals = all_reduce_sums(sums, info.device)
    longest = all_reduce_maxes([float(max(lengths, default=0))], info.device)[0]
    n = totals[2]
    metrics = {"completion_length": totals[0] / n, "completion_length_max": longest,
               "truncated_ratio": totals[1] / n,
               "generated_tokens_per_s": totals[0] / max(totals[3] / info.world_size, 1e-9)}
    for index, (name, _) in enumerate(columns):
        count, total, squares = totals[4 + 3 * index : 7 + 3 * index]
        metrics[name] = total / count if count else math.nan
        metrics[f"{name}_std" if name == "reward" else f"{name}/std"] = std_from_sums(count, total, squares)
    if made.counts is not None:
        calls, failures, malformed = all_reduce_sums(
            [made.counts.calls, made.counts.failures, made.counts.malformed], info.device)
        metrics.update({"tools/call_frequency": calls / n, "tools/failure_frequency": failures / max(calls, 1.0),
                        "tools/malformed_frequency": malformed / n})
    return metrics


def held_out_share(n: int, rank: int, world_size: int) -> tuple[list[int], int]:
    """This rank's held-out prompts, of `n`: a block of n // world_size (one more for the first n % world_size
    ranks), padded to the most a rank has by repeating one (another rank's where it has none); and how many lead
    that are its own. So every prompt is scored once and every rank generates as often (generation is a
    collective)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    own = list(range(start, start + base + int(rank < extra)))
    return own + [own[0] if own else 0] * (base + int(extra > 0) - len(own)), len(own)


def sample_record(tokenizer: PreTrainedTokenizerBase, prompts: Prompts, made: Made, rewards: torch.Tensor,
                  generations: int) -> dict[str, Any]:
    """The first prompt's completions and rewards (rank 0's), for completions.jsonl."""
    texts = tokenizer.batch_decode(made.ids[:generations], skip_special_tokens=True)
    shown = made.messages[:generations] if made.messages is not None else texts  # a multi-turn rollout's messages
    return {"prompt": prompts.prompts[0], "completions": shown, "rewards": rewards[:generations].tolist()}


def saved_generation(g: Generation) -> dict[str, Any]:
    """A generation still in use, for a checkpoint (its `uses` beside it)."""
    return {"ids": [s.input_ids for s in g.samples], "labels": [s.labels for s in g.samples],
            "vision": [s.vision for s in g.samples], "micro_batches": g.micro_batches, "advantages": g.advantages,
            "old_logps": g.old_logps, "ref_logps": g.ref_logps,
            "counts": [g.counts.completions, g.counts.tokens, g.counts.micro_batches], "metrics": g.metrics}


def loaded_generation(state: dict[str, Any]) -> Generation:
    vision = state.get("vision") or [None] * len(state["ids"])  # a checkpoint from before images
    samples = [Sample(ids, labels, images) for ids, labels, images
               in zip(state["ids"], state["labels"], vision, strict=True)]
    return Generation(samples, state["micro_batches"], state["advantages"], state["old_logps"], state["ref_logps"],
                      StepCounts(*state["counts"]), state["metrics"])


def reward_rollouts(tokenizer: PreTrainedTokenizerBase, prompts: Prompts, made: Made, g: int) -> Rollouts:
    """What the reward functions get, as TRL calls them (`g` completions a prompt): for a multi-turn rollout its
    messages (replies and tool results) as the completion, and the environments' instances as `environments`."""
    texts = tokenizer.batch_decode(made.ids, skip_special_tokens=True)
    chat = [is_chat(p) for p in prompts.prompts for _ in range(g)]
    plain: list[Any] = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat, strict=True)]
    completions: list[Any] = list(made.messages) if made.messages else plain
    columns = {name: [v for v in values for _ in range(g)] for name, values in prompts.columns.items()}
    if made.environments is not None:
        columns["environments"] = made.environments
    return Rollouts(made.reward_prompts or [p for p in prompts.prompts for _ in range(g)], completions, made.ids,
                    [r for r in prompts.records for _ in range(g)], columns)
