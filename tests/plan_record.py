"""The shipped recipes' plans, recorded with a fingerprint of everything they were computed from.

Planning every GPU recipe, the 70B plans and the published runs takes a core 18 minutes (1,068 s of CPU,
2026-12-01). The plans change only when what they are computed from changes: the recipes, the model and FSDP configs,
the repo's modules the planner imports (listed in the record as the planner found them in `sys.modules`: a module it
does not import cannot change a plan) and the pinned packages. So tests/fixtures/recipe_plans.json keeps every part's
output beside a hash of each of those files and versions, and the planner job (tests/planners.py) plans:

- everything where the record is missing or any input differs (the tests then read today's plans, and
  `test_the_recorded_plans_are_current_and_equal_todays` fails naming what changed: `make recipe-plans` rewrites
  the record), or where `QLORA_REPLAN=1` forces it (`make test-all`);
- otherwise only REPRESENTATIVE, every run, each held equal to its recorded plan: a fingerprint that missed an input
  would show as a difference there.

    python -m tests.planners --write       # plan every part in full and write the record (make recipe-plans)
    python -m tests.plan_record            # say whether the record is current, and what changed if not
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORD = REPO / "tests" / "fixtures" / "recipe_plans.json"
FORCE = "QLORA_REPLAN"
# this module hashes the inputs and plans nothing: its own changes leave the plans as they are
NOT_AN_INPUT = ("tests/plan_record.py",)
# read by the planner as files, not imported: every file under them counts
DATA_FOLDERS = ("recipes", "model_configs", "fsdp_configs", "benchmarks/data")
PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "safetensors", "tokenizers")
# planned every run: one per objective (SFT, DPO, GRPO with tools), family shape (dense, MoE, vision, sliding
# windows) and lever (CPU offload, long rows split over 2 GPUs, float16, one GPU); each plans in under a minute
REPRESENTATIVE = ("llama70b_2x4090", "qwen3_30b_a3b_1x24gb_dpo", "qwen3_8b_1x24gb_grpo_tools",
                  "qwen2.5_vl_7b_1x24gb_images", "gemma3_27b_2x4090_long", "qwen2.5_32b_2xt4")


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def data_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for folder in DATA_FOLDERS for p in (REPO / folder).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def imported_repo_files() -> list[str]:
    """The repo's source files this process imported (the planner's code, as it ran)."""
    files = set()
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        path = Path(name).resolve() if name and os.path.isabs(name) else None  # torch's _ops: a bare file name
        if path is not None and path.is_relative_to(REPO) and ".venv" not in path.relative_to(REPO).parts:
            files.add(str(path.relative_to(REPO)))
    return sorted(files - set(NOT_AN_INPUT))


def versions() -> dict[str, str]:
    """The packages' pinned versions and Python's minor release (a patch release computes the same plans)."""
    return {"python": ".".join(platform.python_version_tuple()[:2]),
            **{name: metadata.version(name) for name in PACKAGES}}


def inputs(sources: list[str]) -> dict[str, object]:
    """What a plan is computed from: each file's hash (a missing one as None) and the packages' versions."""
    files = {name: (file_hash(REPO / name) if (REPO / name).is_file() else None)
             for name in sorted({*sources, *data_files()})}
    return {"files": files, "versions": versions()}


def load() -> dict | None:
    return json.loads(RECORD.read_text()) if RECORD.is_file() else None


def changes(record: dict | None) -> list[str]:
    """What differs between the record's inputs and today's (empty: the record is current)."""
    if record is None:
        return [f"{RECORD.relative_to(REPO)} is missing"]
    files, packages = record["inputs"]["files"], record["inputs"]["versions"]
    files = {name: digest for name, digest in files.items() if name not in NOT_AN_INPUT}
    today = inputs(list(files))
    today_files, today_packages = today["files"], today["versions"]
    assert isinstance(today_files, dict) and isinstance(today_packages, dict)
    changed = [name for name in sorted({*files, *today_files}) if files.get(name) != today_files.get(name)]
    return changed + [f"{name} {packages.get(name)} -> {version}" for name, version in today_packages.items()
                      if packages.get(name) != version]


def forced() -> bool:
    return os.environ.get(FORCE, "") not in ("", "0")


def write(outputs: dict[str, str], sources: list[str]) -> None:
    """The planner job's outputs (part -> what it printed), with the inputs they were computed from."""
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps({"inputs": inputs(sources), "outputs": outputs}, indent=1, sort_keys=True) + "\n")


def main(argv: list[str]) -> int:
    changed = changes(load())
    print("the recorded plans are current" if not changed else "stale: " + ", ".join(changed))
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
