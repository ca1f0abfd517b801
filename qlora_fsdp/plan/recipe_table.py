"""The README's table of shipped recipes, made from their plans: the planned memory is written in one place, the
planner, and the README shows what it prints (scripts/recipe_table.py writes it; a test holds them equal)."""

from __future__ import annotations

import re
from pathlib import Path

from qlora_fsdp.config import REPO_ROOT, Config, load_config
from qlora_fsdp.families import family_name
from qlora_fsdp.measure.fake_world import leave_fake_world
from qlora_fsdp.measure.planning import Planning
from qlora_fsdp.measure.step_tracker import StepMemory
from qlora_fsdp.plan.generation import planned_generation
from qlora_fsdp.plan.memory import GIB, gpu_spec
from qlora_fsdp.plan.report import RecipePlan, plan_recipe, report_text
from qlora_fsdp.plan.time_report import recipe_time, step_tokens

START, END = "<!-- recipe table: made by scripts/recipe_table.py -->", "<!-- end of recipe table -->"
HEADER = ["| recipe | family | model | hardware | setting | planned GPU memory (rank 0) | host RAM (node) "
          "| predicted tokens/s |", "| --- | --- | --- | --- | --- | --- | --- | ---: |"]



def recipe_names() -> list[str]:
    """Every shipped GPU recipe (the tiny_cpu ones train on any CPU and plan nothing), planned order: by file
    name."""
    return sorted(p.stem for p in (REPO_ROOT / "recipes").glob("*.yaml") if not p.stem.startswith("tiny_cpu"))


def hardware_words(cfg: Config) -> str:
    gpus = f"{cfg.hardware.gpus_per_node}x {cfg.hardware.gpu}"
    return gpus if cfg.hardware.nodes == 1 else f"{cfg.hardware.nodes} nodes x {gpus}"


def setting_words(cfg: Config) -> str:
    """What sets the recipe apart: the context, the dtype, offload and sharding."""
    words = [f"{cfg.data.context_length:,}-token rows", f"{cfg.model.dtype} weights"]
    if cfg.fsdp.cpu_offload:
        words.append("CPU offload")
    if cfg.activation_checkpointing.offload:
        words.append("activation offload")
    if cfg.fsdp.context_parallel > 1:
        words.append(f"each row split over {cfg.fsdp.context_parallel} GPUs")
    if cfg.hardware.nodes > 1 and cfg.fsdp.shard_size:
        words.append(f"HSDP (shards over {cfg.fsdp.shard_size})")
    if cfg.data.images_per_row:
        words.append(f"{cfg.data.images_per_row} image{'s' if cfg.data.images_per_row > 1 else ''} a row")
    return ", ".join(words)


def generation_words(planning: Planning, cfg: Config, step: StepMemory | None) -> str:
    """What the objective generates, and its step's time with what generating takes of it (the tokens/s column
    counts only the tokens the update trains on); nothing for an objective that generates nothing."""
    made = planned_generation(cfg)
    if made is None:
        return ""
    words = (f", {cfg.train.objective.upper()}: {made.completions // made.prompts} completions of up to "
             f"{made.new_tokens} tokens a prompt")
    if step is None or not gpu_spec(cfg).priced:
        return words
    time = recipe_time(planning, cfg, step)
    return words + f"; a step {time.total:,.0f} s, generating {time.generation:,.0f} s of it"


def table_row(name: str, planned: RecipePlan) -> str:
    cfg, result = planned.planned, planned.result
    host = f"{result.host_total / GIB:.1f} GiB" + (f" of {result.host_capacity_gib:g}" if result.host_capacity_gib
                                                   else "")
    verdict = "" if result.fits else " (DOES NOT FIT)"
    rate = (f"{step_tokens(cfg) / recipe_time(planned.planning, cfg, result.step).total:,.0f}"
            if result.step is not None else "")
    setting = setting_words(cfg) + generation_words(planned.planning, cfg, result.step)
    model_type = planned.planning.hf_config.model_type  # the text model's, for a multimodal checkpoint
    family = family_name(model_type)
    return (f"| `{name}` | {family} | {cfg.model.path} | {hardware_words(cfg)} | {setting} | "
            f"{result.gpu_total / GIB:.1f} GiB of {result.capacity_gib:g}{verdict} | {host} | {rate} |")


def plan_alone(name: str) -> RecipePlan:
    """A recipe's plan in a fake world of its own size (recipes differ in world size)."""
    leave_fake_world()
    try:
        return plan_recipe(load_config(name))
    finally:
        leave_fake_world()


def plan_summary(name: str, planned: RecipePlan) -> dict[str, object]:
    """The figures the tests hold a shipped recipe to, its table row and its full report (JSON-ready)."""
    cfg, result = planned.planned, planned.result
    return {"row": table_row(name, planned), "report": report_text(planned), "fits": result.fits,
            "world_size": cfg.hardware.world_size, "context_length": cfg.data.context_length,
            "gpu_gib": result.gpu_total / GIB, "host_gib": result.host_total / GIB,
            "gpu_capacity_gib": result.capacity_gib, "host_capacity_gib": result.host_capacity_gib,
            "dtype": cfg.model.dtype}


def recipe_table(plans: dict[str, RecipePlan] | None = None) -> str:
    """The markdown table; `plans` by recipe name where the caller has planned them already."""
    plans = plans or {name: plan_alone(name) for name in recipe_names()}
    return "\n".join([*HEADER, *(table_row(name, plans[name]) for name in recipe_names())])


def readme_table(readme: Path) -> str:
    """The table as the README holds it now (between the markers)."""
    match = re.search(re.escape(START) + r"\n(.*?)\n" + re.escape(END), readme.read_text(), re.S)
    if match is None:
        raise ValueError(f"{readme} has no recipe table markers ({START})")
    return match.group(1)


def write_readme_table(readme: Path, table: str) -> None:
    text = readme.read_text()
    old = readme_table(readme)
    readme.write_text(text.replace(f"{START}\n{old}\n{END}", f"{START}\n{table}\n{END}"))
