"""What one plan works out once and passes down: the recipe described on its GPUs, and the steps and image sides it
has measured. An auto micro-batch's candidates and a misfit's fixes plan many configs of one recipe; each reuses
what an earlier one measured of the same setting. The plan's caller owns it: `plan_recipe` makes one a plan, and a
planner that lives longer (the studio's plan server) hands its measured steps to every plan it starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transformers import PretrainedConfig

from qlora_fsdp.config import Config
from qlora_fsdp.run.description import RunDescription, planned_run

if TYPE_CHECKING:
    from qlora_fsdp.measure.step_tracker import StepMemory

MeasuredSteps = dict[str, "StepMemory"]  # by measure/step_setting.py's step_setting


@dataclass(frozen=True)
class Planning:
    """A plan's recipe and what it has measured, handed down from plan_recipe."""

    run: RunDescription  # the recipe, described once
    steps: MeasuredSteps = field(default_factory=dict)
    sides: dict[str, Any] = field(default_factory=dict)  # measure/image_side.py's ImageSide, by its image_setting

    @classmethod
    def of(cls, cfg: Config, steps: MeasuredSteps | None = None) -> Planning:
        """The planning of a recipe as written (its `auto` settings resolved here), with steps measured before."""
        return cls(planned_run(cfg), {} if steps is None else steps)

    @property
    def cfg(self) -> Config:
        """The recipe as the plan computes with it (dtypes resolved; an auto micro-batch still auto)."""
        return self.run.cfg

    @property
    def hf_config(self) -> PretrainedConfig:
        return self.run.hf_config

    def built(self, cfg: Config) -> Config:
        """`cfg` (the recipe's resolved config, or a variant of it) as the model is built: its architecture read
        from the run's config folder."""
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=self.run.built.model.path))
