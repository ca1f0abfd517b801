"""The planner's report for `--plan`: the tables, the verdict, and the fixes for a misfit."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from qlora_fsdp.config import Config
from qlora_fsdp.measure.fake_world import planning_mesh
from qlora_fsdp.measure.held import Held, meta_held
from qlora_fsdp.measure.image_side import image_side
from qlora_fsdp.measure.planning import MeasuredSteps, Planning
from qlora_fsdp.measure.step_setting import step_setting
from qlora_fsdp.plan.generation import planned_generation
from qlora_fsdp.plan.levers import Lever, fitting_levers
from qlora_fsdp.plan.memory import (
    GIB,
    Plan,
    activations_peak_line,
    format_rows,
    gpu_spec,
    micro_batch_fits,
    plan,
    with_generation_layout,
)
from qlora_fsdp.plan.time_report import time_lines
from qlora_fsdp.run.batch_size import describe_batch, effective_rows, resolve_batch


@dataclass
class RecipePlan:
    recipe: Config  # as written (an auto micro-batch still auto)
    planned: Config  # the dtypes and micro-batch the plan resolved
    held: Held
    mesh: DeviceMesh
    result: Plan
    planning: Planning  # the recipe described, and what its plan measured (its fixes reuse it)


def plan_recipe(cfg: Config, steps: MeasuredSteps | None = None) -> RecipePlan:
    """The plan of a recipe on its `hardware`, its auto settings resolved as a launch on that hardware would.
    `steps`: steps measured before (the studio's plan server keeps them between plans); this plan's are added."""
    gpu_spec(cfg)  # a mistyped GPU name fails here, before the model is built
    planning = Planning.of(cfg, steps)
    cfg = planning.cfg
    mesh = planning_mesh(cfg.hardware.world_size, cfg.fsdp.shard_size)
    held = meta_held(planning, mesh)
    fits = micro_batch_fits(planning, cfg, held)  # an auto micro-batch where none fits plans 1, to show the misfit
    planned = resolve_batch(cfg, cfg.hardware.world_size, lambda micro: micro == 1 or fits(micro))
    result = plan(planning, planned, held)
    if result.step is not None:  # generation.layout: auto, resolved as the run resolves it
        planned = with_generation_layout(planning, planned, held, result.step)
    return RecipePlan(cfg, planned, held, mesh, result, planning)


def first_step_setting(cfg: Config) -> str:
    """The setting of the recipe's own step, the first its plan measures (its fixes measure others)."""
    planning = Planning.of(cfg)
    return step_setting(planning.built(planning.cfg), planning.hf_config)


def report(cfg: Config) -> tuple[str, bool]:
    """The planner's table and verdict for a recipe; (text, fits)."""
    return report_text(planned := plan_recipe(cfg)), planned.result.fits


def generating_lines(result: Plan) -> list[str]:
    """A generating objective: the device while the policy generates, and which phase is the step's peak."""
    if not result.generating_rows:
        return []
    peak = "generation" if result.generating_total > result.update_total else "the update"
    return ["per GPU (rank 0) while generating:", *format_rows(result.generating_rows),
            f"| **total** | **{result.generating_total / GIB:.2f}** | of {result.capacity_gib:g} GiB |",
            f"the step's peak is {peak}'s: {result.gpu_total / GIB:.2f} GiB", ""]


def image_lines(planning: Planning, cfg: Config, result: Plan) -> list[str]:
    """A recipe with images: what the vision tower's forward holds, against the step's peak."""
    side = image_side(planning, cfg)
    if side is None:
        return []
    where = "below the peak" if result.image_forward_total <= result.update_total else "the step's peak"
    generates = planned_generation(cfg) is not None
    at_once = "a generate call's or a micro-batch's, the more" if generates else "a micro-batch's"
    return [f"images: {side.images} at once ({at_once}) of {side.tokens_per_image} tokens each; the vision tower's "
            f"forward adds {side.forward / GIB:.2f} GiB (estimate) before the decoder's, "
            f"{result.image_forward_total / GIB:.2f} GiB in all: {where}", ""]


def plan_levers(planned: RecipePlan) -> list[Lever]:
    """A misfit's single changes that make it fit (none for a recipe that fits)."""
    if planned.result.fits:
        return []
    return fitting_levers(planned.planning, planned.planned, planned.held, planned.mesh,
                          effective_rows(planned.recipe) is not None)


def report_text(planned: RecipePlan, levers: list[Lever] | None = None) -> str:
    """What `--plan` prints for a planned recipe (`levers`: plan_levers's, where the caller has them)."""
    recipe, cfg, held, result = planned.recipe, planned.planned, planned.held, planned.result
    gpu = f"{cfg.hardware.gpu} ({result.capacity_gib:g} GiB)"
    host_capacity = f"of {result.host_capacity_gib:g} GiB" if result.host_capacity_gib else "unchecked"
    note = activations_peak_line(result.step, result.resident_gpu) if result.step else None
    lines = [f"plan for {cfg.model.path} on {cfg.hardware.world_size} x {gpu}: {result.description}", "",
             f"per GPU (rank 0){' in the update' if result.generating_rows else ''}:", *format_rows(result.gpu_rows),
             f"| **total** | **{result.update_total / GIB:.2f}** | of {result.capacity_gib:g} GiB |",
             *([note] if note else []), "", *generating_lines(result), *image_lines(planned.planning, cfg, result),
             "host RAM, per node:", *format_rows(result.host_rows),
             f"| **total** | **{result.host_total / GIB:.2f}** | {host_capacity} |",
             "", describe_batch(recipe, cfg, cfg.hardware.world_size), "FITS" if result.fits else "DOES NOT FIT"]
    if not result.fits:
        fixes = plan_levers(planned) if levers is None else levers
        lines += ["changes that make it fit, most throughput kept first:", *[f"  - {f}" for f in fixes]] if fixes \
            else ["no single change makes it fit; combine them, or use more GPUs"]
    if result.step is not None:
        lines += time_lines(planned.planning, cfg, held, result.step)
    return "\n".join(lines)
