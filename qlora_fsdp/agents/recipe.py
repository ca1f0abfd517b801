"""A recipe's tools and environments, found once a process (the data, the check before loading and the objective
all ask; an environment factory may be dear to call)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qlora_fsdp.agents.environments import EnvironmentKind, load_environments
from qlora_fsdp.agents.toolbox import Tool, load_tools
from qlora_fsdp.config import GrpoConfig


@dataclass(frozen=True)
class RolloutTools:
    tools: list[Tool]  # grpo.tools: every rollout's
    environments: dict[str | None, EnvironmentKind]  # by name; None: grpo.environment's one

    def schemas(self, environment: str | None) -> list[dict[str, Any]]:
        """What a prompt of this environment (or of none) shows the model: the tools' schemas, TRL's order."""
        methods = self.environments[environment].tools if environment in self.environments else []
        return [tool.schema for tool in [*self.tools, *methods]]


_FOUND: dict[tuple[Any, ...], RolloutTools] = {}


def rollout_tools(grpo: GrpoConfig) -> RolloutTools:
    key = (tuple(grpo.tools), grpo.environment, tuple(sorted(grpo.environments.items())))
    if key not in _FOUND:
        _FOUND[key] = RolloutTools(load_tools(grpo.tools), load_environments(grpo))
    return _FOUND[key]
