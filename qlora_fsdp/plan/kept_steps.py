"""The steps the planner has measured in this process, by setting, and the setting a recipe's plan measures first:
what a long-lived planner (the studio's plan server) keeps between plans made in processes it forks."""

from __future__ import annotations

from qlora_fsdp.config import Config
from qlora_fsdp.measure.fake_step import measured_steps, remember_steps, step_setting
from qlora_fsdp.run.description import planned_run

__all__ = ["first_step_setting", "measured_steps", "remember_steps"]  # the studio reaches the measured steps here


def first_step_setting(cfg: Config) -> str:
    """The setting of the recipe's own step, the first its plan measures (its fixes measure others)."""
    run = planned_run(cfg)
    return step_setting(run.built, run.hf_config)

