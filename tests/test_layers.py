"""The package's layers: each sub-package imports only the layers below it (data flows one way)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "qlora_fsdp"
BASE = {"errors", "labels", "dtypes", "optimizer_registry", "distributed", "config", "precision"}
# what each part of the package may import (besides itself)
ALLOWED = {
    "errors": set(), "labels": set(), "dtypes": set(), "optimizer_registry": set(),
    "distributed": {"errors"},  # the process group, its first check, and how its ranks end on an error
    "config": {"errors", "optimizer_registry"},
    "precision": {"config", "dtypes", "errors", "optimizer_registry"},
    "data": BASE,  # never model/: data and model do not know each other
    "model": BASE,
    "training": BASE | {"data", "model"},
    "plan": BASE | {"data", "model", "training"},  # the planner runs training's own step on fake tensors
    "tools": BASE | {"data", "model"},  # never api.py: the tools do not start training
    "api": BASE | {"data", "model", "training", "plan"},
    "commands": BASE | {"api", "plan", "data", "model", "tools"},  # the command lines: the top
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
