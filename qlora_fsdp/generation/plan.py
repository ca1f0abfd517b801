"""A step's generation, resolved once from the recipe: what is generated (a rank's prompts, completions each, new
tokens, sampling), in how many calls of how many rows, and the layout's rule. The objective that generates makes
it (Objective.planned_generation); the run's decoder, the planner's memory and its time read this one object, so
the three agree on the rows of a call and on the layout `auto` takes."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from qlora_fsdp.config import GenerationConfig, GenerationLayout

Layout = Literal["per_token", "gathered", "split"]


@dataclass(frozen=True)
class GenerationPlan:
    """What a generating objective's step generates on one rank, and how."""

    settings: GenerationConfig  # the recipe's `generation` section: sampling, rows a call, layout, graphs, kernels
    prompts: int  # a rank's prompts a step (a record each)
    prompt_tokens: int  # the longest prompt a recipe allows (the context less max_completion_length)
    steps_served: int = 1  # optimizer steps one generation serves
    kept_forwards: int = 0  # forwards over a generation's completions whose log-probabilities the update keeps
    tool_rounds: int = 0  # rounds of tool results a rollout may take (the plan prices them)

    @property
    def completions(self) -> int:
        """The completions a rank generates a step."""
        return self.prompts * self.settings.num_generations

    @property
    def new_tokens(self) -> int:
        return self.settings.max_completion_length

    @property
    def rows(self) -> int:
        """Completions a generate call takes together: generation.rows, at most the rank's step."""
        return max(1, min(self.settings.rows or self.completions, self.completions))

    @property
    def calls(self) -> int:
        return math.ceil(self.completions / self.rows)


def chosen_layout(setting: GenerationLayout, world_size: int, gathered_fits: Callable[[], bool],
                  split_fits: Callable[[], bool]) -> Layout:
    """The one rule for `generation.layout`: the recipe's layout, or for auto gathered where the whole model and
    the KV cache fit, else split where a rank's share of the layers and the cache fit, else per_token (the weights
    as training holds them: the least memory, the most link traffic). The run asks the GPU's free memory, the plan
    its planned bytes."""
    if setting != "auto":
        return setting
    if gathered_fits():
        return "gathered"
    if world_size > 1 and split_fits():
        return "split"
    return "per_token"
