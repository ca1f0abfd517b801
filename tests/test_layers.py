"""The package's layers: each sub-package imports only the layers below it (data flows one way)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "qlora_fsdp"
BASE = {"errors", "labels", "dtypes", "optimizer_registry", "distributed", "config", "precision", "families", "agents",
        "torch_versions"}
MODEL = {"layers", "losses", "loading"}
# what each part of the package may import (besides itself)
ALLOWED = {
    "errors": set(), "labels": set(), "dtypes": set(), "optimizer_registry": set(),
    "distributed": {"errors"},  # the process group, its first check, and how its ranks end on an error
    "config": {"errors", "optimizer_registry"},
    "precision": {"config", "dtypes", "errors", "optimizer_registry"},
    "families": {"errors"},  # what differs between model families, asked by everything above
    "torch_versions": {"errors"},  # the torch releases run on, and an older one's missing fixes patched in
    "agents": {"errors", "config"},  # GRPO's tools and environments: user code, found, run and read back
    "data": BASE,  # never the model's packages: data and model do not know each other
    "layers": BASE,  # modules that compute, knowing nothing of files or losses
    "losses": BASE | {"layers"},
    "kernels": BASE | {"layers"},  # Triton kernels and the generation forwards that call them
    "loading": BASE | {"layers"},  # checkpoints -> the built, sharded, filled model
    "rewards": BASE,  # GRPO's reward functions: the recipe's, found and called (user code, never the model)
    "run": BASE | {"loading"},  # the run described once: the model's folder, batch sizes, known GPUs
    "optimizer": BASE | {"layers"},  # local-shard optimizers, their groups and schedules
    "run_files": BASE | {"loading", "optimizer"},  # checkpoints, metrics, plots, tracking, the output folder
    # one module per kind of training objective, one table (config/objectives.py) naming them
    "generation": BASE | MODEL,  # where the policy's weights are while it generates, and what that holds
    "objectives": BASE | {"data", "rewards", *MODEL, "kernels", "generation", "run", "run_files"},
    "training": BASE | {"data", *MODEL, "objectives", "optimizer", "run", "run_files"},  # the loop
    # the step measured: the objective's own micro-step on fake tensors, or on a real model
    "measure": BASE | {"data", *MODEL, "objectives", "optimizer", "run"},
    # memory and time, read off the measured step
    "plan": BASE | {"data", *MODEL, "generation", "measure", "objectives", "run"},
    "auto_batch": BASE | {"measure", "plan", "run"},  # a launched run's micro-batch, from the plan
    "tools": BASE | {"data", *MODEL, "run"},  # never api.py: the tools do not start training
    "api": BASE | {"data", *MODEL, "rewards", "objectives", "optimizer", "run", "run_files", "training", "auto_batch"},
    # the local web page: the plan, the run's files, chat through the tools; training only as a torchrun it starts
    "studio": BASE | {"data", "loading", "plan", "run_files", "tools"},
    "commands": BASE | {"api", "plan", "measure", "run", "data", *MODEL, "tools", "studio"},  # the command lines
    "__init__": {"api", "config"},
}


def imported_layers(path: Path) -> set[str]:
    layers = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qlora_fsdp."):
            layers.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            layers.update(a.name.split(".")[1] for a in node.names if a.name.startswith("qlora_fsdp."))
    return layers


def layer_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def test_every_module_imports_only_lower_layers():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 30
    for path in modules:
        layer = layer_of(path)
        assert layer in ALLOWED, f"{path.relative_to(PACKAGE)}: a new layer; give it a row in ALLOWED"
        upward = imported_layers(path) - ALLOWED[layer] - {layer}
        assert not upward, f"{path.relative_to(PACKAGE)} imports {sorted(upward)}"


def imported_modules(path: Path) -> set[str]:
    """The package's modules `path` imports, at its top or inside a function (a lazy import still makes a loop)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qlora_fsdp"):
            for alias in node.names:  # `from qlora_fsdp.loading import stored_forms` names a module
                submodule = PACKAGE.parent / f"{node.module}.{alias.name}".replace(".", "/")
                found.add(f"{node.module}.{alias.name}" if submodule.with_suffix(".py").is_file() else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("qlora_fsdp"))
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_loops():
    graph = {module_name(path): imported_modules(path) for path in PACKAGE.rglob("*.py")}
    assert sum(len(targets) for targets in graph.values()) > 100
    done: set[str] = set()

    def visit(module: str, stack: list[str]) -> None:
        if module in stack:
            loop = stack[stack.index(module):] + [module]
            raise AssertionError(f"import loop: {' -> '.join(loop)}")
        if module in done or module not in graph:
            return
        for target in sorted(graph[module]):
            visit(target, [*stack, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_modules_and_functions_stay_short():
    long_modules, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 400:
            long_modules.append(f"{path.relative_to(PACKAGE)} ({text.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long_functions.append(f"{path.relative_to(PACKAGE)}:{node.name} ({length} lines)")
    assert not long_modules, f"modules over 400 lines: {long_modules}"
    assert not long_functions, f"functions over 60 lines: {long_functions}"


def test_objective_names_are_compared_in_the_table_and_validation_only():
    """`train.objective` is read through its row of config/objectives.py's table: no other module compares it,
    and the table has a row for every name the schema accepts."""
    from typing import get_args

    from qlora_fsdp.config.objectives import OBJECTIVES, Objective

    assert set(OBJECTIVES) == set(get_args(Objective))
    allowed = {PACKAGE / "config" / "objectives.py", PACKAGE / "config" / "validation.py"}
    comparing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(side, ast.Attribute) and side.attr == "objective"
                    for side in (node.left, *node.comparators)) and path not in allowed:
                comparing.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert comparing == [], "ask the objective's row (cfg.train.kind) instead"
