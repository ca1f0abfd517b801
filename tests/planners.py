"""The planners the tests read, in one process beside the test sequence (tests/background.py): every shipped recipe's
plan (for tests/test_plan.py's `recipe_plans`), the 70B test's own plans (`plans_70b`) and the published runs planned
and priced (`python -m benchmarks.published_runs --json`, for tests/test_step_time.py's `published_runs`).

Each part prints what its command prints; this process imports torch and the planner once for all of them (three
processes paid that three times), and a step setting two parts plan is measured once (measure/fake_step.py's cache of
the measured step, keyed by everything the step depends on: the 70B recipe's own plans are among the table's, the
published runs share settings). Only the parts a selected test needs run.

What the parts compute is recorded (tests/plan_record.py): where nothing they are computed from changed since, the
record answers and only its representative recipes are planned again, each held to its recorded plan; otherwise
(or with QLORA_REPLAN=1) every part runs in full.

    python -m tests.planners recipe_plans,plans_70b,published_runs WORK   # a JSON object: part -> its output
    python -m tests.planners --write                                      # plan all, write the record
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tests import plan_record

REPO = Path(__file__).resolve().parent.parent


def no_fetch() -> None:
    """The recipes name hub data and models; a plan reads neither."""
    import datasets
    import huggingface_hub

    def fetch(*args: object, **kwargs: object) -> None:
        raise SystemExit(f"planning fetched {args[:1]}")

    datasets.load_dataset = huggingface_hub.snapshot_download = fetch


def run_as_main(argv: list[str], run: Callable[[], object]) -> None:
    saved = sys.argv
    sys.argv = argv
    try:
        run()
    finally:
        sys.argv = saved


def recipe_plans(work: Path, names: tuple[str, ...] | None = None) -> None:
    """Every shipped recipe's figures, row and report (what scripts/recipe_table.py --json prints), or those named."""
    from qlora_fsdp.plan.recipe_table import plan_alone, plan_summary, recipe_names

    print(json.dumps({name: plan_summary(name, plan_alone(name)) for name in names or recipe_names()}))


def published_runs(work: Path) -> None:
    """The step-time model against published runs: python -m benchmarks.published_runs --json."""
    import benchmarks.published_runs  # in sys.modules: the record's inputs list it

    run_as_main(["benchmarks/published_runs.py", "--json"], benchmarks.published_runs.main)


def plans_70b(work: Path) -> None:
    """llama70b_2x4090 without and with offload, its single fixes, its rows; an 8B with full logits on 12 GiB."""
    import torch.distributed as dist
    from transformers import LlamaConfig

    from qlora_fsdp.config import load_config
    from qlora_fsdp.measure.fake_world import planning_mesh
    from qlora_fsdp.measure.held import meta_held
    from qlora_fsdp.measure.planning import Planning
    from qlora_fsdp.plan.levers import variants
    from qlora_fsdp.plan.memory import GIB, activations_peak_line, plan
    from qlora_fsdp.plan.report import report

    cfg = load_config("llama70b_2x4090", ["fsdp_preset=full_shard"])
    planning = Planning.of(cfg)
    cfg = planning.cfg
    held = meta_held(planning, planning_mesh(2))  # one meta build for both presets: offload moves bytes, not shapes
    offload = Planning.of(load_config("llama70b_2x4090", ["fsdp_preset=full_shard_cpu_offload"])).cfg
    for name, c in (("full_shard", cfg), ("full_shard_cpu_offload", offload)):
        result = plan(planning, c, held)
        print(name, "FITS" if result.fits else "DOES NOT FIT", round(result.gpu_total / 2**30, 2))
    print(result.description)
    print([label for label, _, c in variants(cfg) if c.lora.r == cfg.lora.r and plan(planning, c, held).fits])
    for row in result.gpu_rows:
        print("row", row.basis, round(row.bytes / GIB, 3), row.name)
    print("largest activations:", activations_peak_line(result.step, result.resident_gpu))
    dist.destroy_process_group()
    # the 8B's layer shapes and vocabulary, 2 layers (its misfit fixes are as many steps: 32 layers would take 40 s)
    eight_b = work / "8b-2-layers"
    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False).save_pretrained(eight_b)
    text, fits = report(load_config("llama3_8b_1x4090", [f"model.path={eight_b}", "loss.chunked=false",
                                                         "hardware.gpu_memory_gib=12"]))
    print(text)


PARTS: dict[str, Callable[[Path], None]] = {"recipe_plans": recipe_plans, "plans_70b": plans_70b,
                                            "published_runs": published_runs}
# one OpenMP thread, as tests/__init__.py says of the planners: the job shares the test sequence's idle core
ENV = {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def register() -> None:
    """The job, for tests/background.py: each test module that reads a part calls this at import (once counts)."""
    from tests import background

    if not set(PARTS) <= background.job_names():
        forced = {plan_record.FORCE: os.environ[plan_record.FORCE]} if plan_record.forced() else {}
        background.register_shared(list(PARTS), [sys.executable, "-m", "tests.planners", background.PARTS,
                                                 background.WORK], {**ENV, **forced}, timeout=1800)


def planned(fixture: str) -> dict:
    """The whole answer of the job that serves `fixture` (waits for it): `outputs` (part -> what it printed), `stale`
    (what changed since the record), `replanned`, `fresh` (the recipes planned in this run), `recorded` (the
    record's outputs, or None)."""
    from tests import background

    done = background.result(fixture)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def part(fixture: str) -> str:
    """What the part of `fixture` printed (waits for the job)."""
    return planned(fixture)["outputs"][fixture]


def run_parts(parts: list[str], work: Path, recipes: tuple[str, ...] | None = None) -> dict[str, str]:
    from qlora_fsdp.measure.fake_world import leave_fake_world

    no_fetch()
    outputs = {}
    for name in parts:
        leave_fake_world()  # each part plans in fake worlds of its own sizes
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            if name == "recipe_plans":
                recipe_plans(work, recipes)
            else:
                PARTS[name](work)
        outputs[name] = printed.getvalue()
    return outputs


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        with tempfile.TemporaryDirectory() as work:
            outputs = run_parts(list(PARTS), Path(work))
        plan_record.write(outputs, plan_record.imported_repo_files())
        print(f"wrote {plan_record.RECORD.relative_to(REPO)}: {len(json.loads(outputs['recipe_plans']))} recipes")
        return 0
    parts, work = argv[0].split(","), Path(argv[1])
    record = plan_record.load()
    stale = plan_record.changes(record)
    replan = bool(stale) or plan_record.forced()
    if replan:
        outputs = run_parts(parts, work)
    else:  # the record answers; the representative recipes are planned again to be held to it
        assert record is not None
        outputs = {**{name: record["outputs"][name] for name in parts},
                   **run_parts([name for name in parts if name == "recipe_plans"], work, plan_record.REPRESENTATIVE)}
    fresh = sorted(json.loads(outputs["recipe_plans"])) if "recipe_plans" in outputs else []
    if not replan and "recipe_plans" in outputs:  # the fixture reads every recipe: the record's, today's over them
        outputs["recipe_plans"] = json.dumps({**json.loads(record["outputs"]["recipe_plans"]),
                                              **json.loads(outputs["recipe_plans"])})
    print(json.dumps({"outputs": outputs, "stale": stale, "replanned": replan, "fresh": fresh,
                      "recorded": record["outputs"] if record else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
