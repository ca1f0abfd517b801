"""The recipe's reward functions: found before any weight is loaded, called as TRL calls them, and checked.

A function is a built-in's name or `module:function` (a module importable from the working directory, or a
`path/to/file.py:function`). It gets `prompts`, `completions` (text, or the assistant's message for chat prompts),
`completion_ids` and every other column of the dataset as keyword arguments, one entry per completion, and returns
one float or None (not applicable) per completion. A function that raises, returns another count or NaN stops the
run in one line naming it and the prompt's index in the dataset.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qlora_fsdp.agents.user_code import import_function
from qlora_fsdp.config import GenerationConfig, RewardConfig
from qlora_fsdp.errors import ConfigError, UserError
from qlora_fsdp.rewards.builtin import BUILTINS, RewardFunction, builtin


class RewardError(UserError):
    """A reward function failed on the run's data."""


@dataclass(frozen=True)
class Reward:
    name: str
    function: RewardFunction
    weight: float


# a built-in that needs the model code (a reward model): made from its options by a layer that may load models
BuiltinFactory = Callable[[dict[str, Any]], RewardFunction]


def resolve(config: RewardConfig, generation: GenerationConfig, factories: dict[str, BuiltinFactory]) -> Reward:
    if config.function in factories:
        return Reward(config.function, factories[config.function](config.options), config.weight)
    if ":" not in config.function:
        found = builtin(config.function, config.options, generation.max_completion_length)
        if found is None:
            raise ConfigError(f"unknown reward function {config.function!r}: a built-in "
                              f"({', '.join([*BUILTINS, *factories])}) or module:function")
        return Reward(config.function, found, config.weight)
    if config.options:
        raise ConfigError(f"reward function {config.function!r}: options are for built-ins; give yours defaults")
    return Reward(config.function, import_function(config.function, "reward function"), config.weight)


def resolve_rewards(rewards: list[RewardConfig], generation: GenerationConfig, section: str = "grpo",
                    factories: dict[str, BuiltinFactory] | None = None) -> list[Reward]:
    """Every reward function of the recipe's objective section (`section`.rewards), or a ConfigError naming the
    first that cannot be had. `factories`: the built-ins made elsewhere (api.py gives `reward_model`)."""
    if not rewards:
        raise ConfigError(f"train.objective {section} needs at least one reward function in {section}.rewards")
    return [resolve(config, generation, factories or {}) for config in rewards]


@dataclass(frozen=True)
class Rollouts:
    """One rank's completions, grouped: completions[i] answers prompts[i] (each prompt repeated num_generations
    times in a row); record_ids[i] is the prompt's index in the dataset; columns hold its other fields."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    record_ids: list[int]
    columns: dict[str, list[Any]]


def call_one(reward: Reward, rollouts: Rollouts) -> list[Any]:
    try:
        return list(reward.function(prompts=rollouts.prompts, completions=rollouts.completions,
                                    completion_ids=rollouts.completion_ids, **rollouts.columns))
    except Exception as error:  # noqa: BLE001 (any failure of user code stops the run in one line)
        message = str(error).splitlines()[0] if str(error) else ""
        raise RewardError(f"reward function {reward.name} raised {type(error).__name__}: {message} (prompt "
                          f"{first_failing(reward, rollouts)} of the dataset)") from None


def first_failing(reward: Reward, rollouts: Rollouts) -> int:
    """The dataset index of the first prompt whose completions alone make the function raise."""
    for index, record in enumerate(rollouts.record_ids):
        if index and record == rollouts.record_ids[index - 1]:
            continue
        rows = [i for i, r in enumerate(rollouts.record_ids) if r == record]
        try:
            reward.function(prompts=[rollouts.prompts[i] for i in rows],
                            completions=[rollouts.completions[i] for i in rows],
                            completion_ids=[rollouts.completion_ids[i] for i in rows],
                            **{key: [values[i] for i in rows] for key, values in rollouts.columns.items()})
        except Exception:  # noqa: BLE001
            return record
    return rollouts.record_ids[0]


def checked(reward: Reward, values: list[Any], rollouts: Rollouts) -> list[float]:
    if len(values) != len(rollouts.completions):
        raise RewardError(f"reward function {reward.name} returned {len(values)} values for "
                          f"{len(rollouts.completions)} completions (prompts {rollouts.record_ids[0]}..."
                          f"{rollouts.record_ids[-1]} of the dataset); return one float or None per completion")
    scores = []
    for index, value in enumerate(values):
        try:
            number = math.nan if value is None else float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or (value is not None and not math.isfinite(number)):
            raise RewardError(f"reward function {reward.name} returned {value!r} for a completion of prompt "
                              f"{rollouts.record_ids[index]} of the dataset; return a finite float or None")
        scores.append(number)
    return scores


def score(rewards: list[Reward], rollouts: Rollouts) -> torch.Tensor:
    """(completions, functions): each function's checked scores, NaN where it returned None."""
    columns = [checked(reward, call_one(reward, rollouts), rollouts) for reward in rewards]
    return torch.tensor(columns, dtype=torch.float32).T.reshape(len(rollouts.completions), len(rewards))


def combined(scores: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """Each completion's reward: the weighted sum of the scores it got (None ones left out), NaN if it got none."""
    weighted = scores * torch.tensor(weights, dtype=scores.dtype)
    total = torch.nansum(weighted, dim=1)
    return torch.where(torch.isnan(scores).all(dim=1), torch.full_like(total, math.nan), total)
