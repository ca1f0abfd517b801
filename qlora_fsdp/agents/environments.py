"""Environments as TRL 1.16's GRPOTrainer(environment_factory=...) takes them.

A factory (`grpo.environment: module:make_env`, or `grpo.environments: {name: module:make_env}` with an
`environment` column choosing one per record) returns an environment: its public methods are the rollout's tools
(type hints and docstrings, as any tool), `reset(**record)` starts a rollout and returns None or text appended to
the last user message, and an optional `get_reward()` scores the finished rollout from the environment's state
(a reward of weight 1 named after the class). One instance per rollout, kept across its turns; instances are
reused from step to step (constructed once, reset often), as TRL does.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qlora_fsdp.agents.toolbox import Tool, tool_of
from qlora_fsdp.agents.user_code import import_function
from qlora_fsdp.config import GrpoConfig
from qlora_fsdp.errors import ConfigError, UserError, first_line

NOT_TOOLS = ("reset", "get_reward")


class EnvironmentError_(UserError):  # noqa: N801 (the builtin EnvironmentError is OSError's alias)
    """An environment's reset failed on a record."""


def method_names(environment: Any) -> list[str]:
    """The environment's tools: its class's public functions but reset and get_reward, in name order (TRL's)."""
    return [name for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")]


@dataclass(frozen=True)
class EnvironmentKind:
    name: str | None  # None: the one factory of grpo.environment
    factory: Callable[[], Any]
    kind: type  # the class its instances are (get_reward is asked of these only)
    tools: list[Tool]  # schemas from a probe instance: what the prompt shows


def probe(name: str | None, spec: str) -> EnvironmentKind:
    where = f"environment {spec!r}"
    factory = import_function(spec, "environment")
    try:
        instance = factory()
    except Exception as error:  # noqa: BLE001 (user code: one line)
        raise ConfigError(f"{where}: calling it raised {type(error).__name__}: {first_line(error)}") from None
    if not callable(getattr(instance, "reset", None)):
        raise ConfigError(f"{where}: the environment it returns needs a reset() method (None, or text for the "
                          "prompt)")
    tools = [tool_of(getattr(instance, method), f"{where}: method {method}") for method in method_names(instance)]
    if not tools:
        raise ConfigError(f"{where}: the environment has no public methods, so the model has no tools to act with")
    return EnvironmentKind(name, factory, type(instance), tools)


def load_environments(grpo: GrpoConfig) -> dict[str | None, EnvironmentKind]:
    """Each environment of the recipe by name (None for the single grpo.environment); {} without any."""
    if grpo.environment:
        return {None: probe(None, grpo.environment)}
    return {name: probe(name, spec) for name, spec in grpo.environments.items()}


def environment_of(record: dict[str, Any], kinds: dict[str | None, EnvironmentKind], where: str) -> str | None:
    """The record's environment: none, the one there is, or its `environment` column among grpo.environments."""
    if not kinds or None in kinds:
        return None
    name = record.get("environment")
    if name not in kinds:
        raise EnvironmentError_(f"{where}: environment {name!r} is not among grpo.environments "
                                f"({', '.join(str(n) for n in kinds)}); give each record an `environment` column "
                                "naming one")
    return name


@dataclass
class EnvironmentPool:
    """Instances by environment, handed out one per rollout each step and reused the next."""

    kinds: dict[str | None, EnvironmentKind]
    made: dict[str | None, list[Any]] = field(default_factory=dict)

    def instances(self, names: list[str | None]) -> list[Any]:
        taken: dict[str | None, int] = {}
        out = []
        for name in names:
            pool = self.made.setdefault(name, [])
            index = taken.get(name, 0)
            if index == len(pool):
                pool.append(self.kinds[name].factory())
            taken[name] = index + 1
            out.append(pool[index])
        return out


def reset(environment: Any, record: dict[str, Any], where: str) -> str | list | None:
    try:
        return environment.reset(**record)
    except Exception as error:  # noqa: BLE001 (user code: one line naming the record)
        raise EnvironmentError_(f"{where}: the environment's reset raised {type(error).__name__}: "
                                f"{first_line(error)}") from None


def tools_of(environment: Any, standalone: list[Tool]) -> dict[str, Callable[..., Any]]:
    """What a rollout may call: the recipe's tools and the methods of its own environment instance."""
    found = {tool.name: tool.function for tool in standalone}
    if environment is not None:
        found.update({name: getattr(environment, name) for name in method_names(environment)})
    return found


async def awaited(value: Any) -> Any:
    """An awaitable's result (TRL awaits an async get_reward); asyncio.run takes coroutines only."""
    return await value


def reward_functions(kinds: dict[str | None, EnvironmentKind]) -> list[tuple[str, Callable[..., list[Any]]]]:
    """(class name, reward function) for each environment class with get_reward: called as TRL calls a reward
    function (`environments=` holds the rollouts' instances), None for rollouts of other environments."""
    out: list[tuple[str, Callable[..., list[Any]]]] = []
    for kind in dict.fromkeys(k.kind for k in kinds.values()):
        if not callable(getattr(kind, "get_reward", None)):
            continue

        def scores(environments: list[Any], _kind: Any = kind, **_: Any) -> list[Any]:
            found = [e.get_reward() if type(e) is _kind else None for e in environments]
            return [asyncio.run(awaited(value)) if inspect.isawaitable(value) else value for value in found]

        out.append((kind.__name__, scores))
    return out
