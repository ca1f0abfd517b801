"""The planners the tests read, in one process beside the test sequence (tests/background.py): every shipped recipe's
plan (`scripts/recipe_table.py --json`, for tests/test_plan.py's `recipe_plans`), the 70B test's own plans
(`plans_70b`) and the published runs planned and priced (`python -m benchmarks.published_runs --json`, for
tests/test_step_time.py's `published_runs`).

Each part prints what its command prints; this process imports torch and the planner once for all of them (three
processes paid that three times), and a step setting two parts plan is measured once (measure/fake_step.py's cache of
the measured step, keyed by everything the step depends on: the 70B recipe's own plans are among the table's, the
published runs share settings). Only the parts a selected test needs run.

    python -m tests.planners recipe_plans,plans_70b,published_runs WORK   # a JSON object: part -> its output
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

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


def recipe_plans(work: Path) -> None:
    """Every shipped recipe's figures, row and report: scripts/recipe_table.py --json."""
    run_as_main(["scripts/recipe_table.py", "--json"],
                lambda: runpy.run_path(str(REPO / "scripts" / "recipe_table.py"), run_name="__main__"))


def published_runs(work: Path) -> None:
    """The step-time model against published runs: python -m benchmarks.published_runs --json."""
    run_as_main(["benchmarks/published_runs.py", "--json"],
                lambda: runpy.run_module("benchmarks.published_runs", run_name="__main__", alter_sys=False))


def plans_70b(work: Path) -> None:
    """llama70b_2x4090 without and with offload, its single fixes, its rows; an 8B with full logits on 12 GiB."""
    import torch.distributed as dist
    from transformers import LlamaConfig

    from qlora_fsdp.config import load_config
    from qlora_fsdp.measure.fake_world import planning_mesh
    from qlora_fsdp.measure.held import meta_held
    from qlora_fsdp.plan.levers import variants
    from qlora_fsdp.plan.memory import GIB, activations_peak_line, plan
    from qlora_fsdp.plan.report import report

    cfg = load_config("llama70b_2x4090", ["fsdp_preset=full_shard"])
    held = meta_held(cfg, planning_mesh(2))  # one meta build for both presets: offload moves bytes, not shapes
    offload = load_config("llama70b_2x4090", ["fsdp_preset=full_shard_cpu_offload"])
    for name, c in (("full_shard", cfg), ("full_shard_cpu_offload", offload)):
        result = plan(c, held)
        print(name, "FITS" if result.fits else "DOES NOT FIT", round(result.gpu_total / 2**30, 2))
    print(result.description)
    print([label for label, _, c in variants(cfg) if c.lora.r == cfg.lora.r and plan(c, held).fits])
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
ENV = {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}


def register() -> None:
    """The job, for tests/background.py: each test module that reads a part calls this at import (once counts)."""
    from tests import background

    if not set(PARTS) <= background.job_names():
        background.register_shared(list(PARTS), [sys.executable, "-m", "tests.planners", background.PARTS,
                                                 background.WORK], ENV, timeout=900)


def part(fixture: str) -> str:
    """What the part of `fixture` printed (waits for the job)."""
    from tests import background

    done = background.result(fixture)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)[fixture]


def main(argv: list[str]) -> int:
    from qlora_fsdp.measure.fake_world import leave_fake_world

    parts, work = argv[0].split(","), Path(argv[1])
    no_fetch()
    outputs = {}
    for part in parts:
        leave_fake_world()  # each part plans in fake worlds of its own sizes
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            PARTS[part](work)
        outputs[part] = printed.getvalue()
    print(json.dumps(outputs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
