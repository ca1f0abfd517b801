"""The package's layers: each sub-package imports only the layers below it (data flows one way)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "qlora_fsdp"
BASE = {"errors", "labels", "dtypes", "optimizer_registry", "distributed", "config", "precision", "families", "agents",
        "torch_versions"}
MODEL = {"layers", "vision", "losses", "loading"}
# what each part of the package may import (besides itself)
ALLOWED = {
    "errors": set(), "labels": set(), "dtypes": set(), "optimizer_registry": set(),
    "distributed": {"errors"},  # the process group, its first check, and how its ranks end on an error
    "config": {"errors", "optimizer_registry"},
    "precision": {"config", "dtypes", "errors", "optimizer_registry"},
    "families": {"errors"},  # what differs between model families, asked by everything above
    "torch_versions": {"errors"},  # the torch releases run on, and an older one's missing fixes patched in
    "agents": {"errors", "config"},  # GRPO's tools and environments: user code, found, run and read back
    # never the model's packages (data and model do not know each other), nor agents/: GRPO's tools reach the
    # prompts through the caller (objectives/tool_templates.py)
    "data": BASE - {"agents"},
    "layers": BASE,  # modules that compute, knowing nothing of files or losses
    # training through the export: llama.cpp's quantizers in torch, each tensor's type, the rounded forward
    "gguf_target": BASE | {"layers", "kernels"},
    "vision": BASE | {"layers"},  # the image side inside the decoder's forward: features at the image tokens
    "losses": BASE | {"layers", "vision"},
    "kernels": BASE | {"layers"},  # Triton kernels and the generation forwards that call them
    "loading": BASE | {"layers", "vision", "gguf_target"},  # checkpoints -> the built, sharded, filled model
    "rewards": BASE,  # GRPO's reward functions: the recipe's, found and called (user code, never the model)
    "run": BASE | {"loading"},  # the run described once: the model's folder, batch sizes, known GPUs
    "optimizer": BASE | {"layers"},  # local-shard optimizers, their groups and schedules
    "outputs": BASE | {"loading", "optimizer"},  # checkpoints, metrics, plots, tracking, the output folder
    # one module per kind of training objective, one table (config/objectives.py) naming them
    "generation": BASE | MODEL,  # where the policy's weights are while it generates, and what that holds
    "objectives": BASE | {"data", "rewards", *MODEL, "kernels", "generation", "run", "outputs"},
    "training": BASE | {"data", *MODEL, "objectives", "optimizer", "run", "outputs"},  # the loop
    # the step measured: the objective's own micro-step on fake tensors, or on a real model
    "measure": BASE | {"data", *MODEL, "objectives", "optimizer", "run", "kernels"},
    # memory and time, read off the measured step
    "plan": BASE | {"data", *MODEL, "generation", "measure", "objectives", "run"},
    "auto_batch": BASE | {"measure", "plan", "run"},  # a launched run's micro-batch, from the plan
    "tools": BASE | {"data", *MODEL, "run"},  # never api.py: the tools do not start training
    "api": BASE | {"data", *MODEL, "rewards", "objectives", "optimizer", "run", "outputs", "training", "auto_batch"},
    # the local web page: the plan, the run's files, chat through the tools; training only as a torchrun it starts
    "readouts": BASE | {"data", "loading"},  # what the studio shows, without Gradio: the data, the machine's GPUs
    "studio": BASE | {"data", "loading", "plan", "outputs", "tools", "readouts"},
    "commands": BASE | {"api", "plan", "measure", "run", "data", *MODEL, "tools", "studio", "outputs"},  # command lines
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


# where an objective's name or its kind may be looked at: the table, validation, the schema's `kind`, and the data
# layer's choice of reader by the kind of data
# the tables, validation, and the two places that choose the data's reader by its kind: the run's and the studio's
# data preview (which reads and shows what that reader would)
DISPATCH_ALLOWED = {"config/objectives.py", "config/validation.py", "config/generating_checks.py", "config/schema.py",
                    "objectives/table.py",
                    "data/training_data.py", "readouts/data_preview.py"}


def objective_subclasses() -> set[str]:
    """The objective classes and the pair losses (besides their bases): an isinstance on one is a dispatch."""
    bases: dict[str, set[str]] = {}
    for path in [*(PACKAGE / "objectives").glob("*.py"), PACKAGE / "losses" / "pair_losses.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {b.id for b in node.bases if isinstance(b, ast.Name)}
    found = {"Objective", "PairLoss"}
    while grown := {name for name, parents in bases.items() if parents & found} - found:
        found |= grown
    return found - {"Objective", "PairLoss"}


def names_an_objective(node: ast.AST, aliases: set[str], kinds: frozenset[str] = frozenset()) -> bool:
    """`<anything>.objective`, `<anything>.kind.<field>`, `<a name bound to a .kind>.<field>`, or a local name bound
    to one of them."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    if not isinstance(node, ast.Attribute):
        return False
    kind = node.value
    return node.attr == "objective" or (isinstance(kind, ast.Attribute) and kind.attr == "kind") or (
        isinstance(kind, ast.Name) and kind.id in kinds)


def dispatches(tree: ast.AST, classes: set[str]) -> list[int]:
    """Lines that tell objectives apart by name or kind: a comparison, a local alias compared, `match`, a dict's
    `.get` or subscript, or isinstance/issubclass on an objective's class or pair loss."""
    assigned = [(target.id, node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)]
    kinds = frozenset(name for name, value in assigned if isinstance(value, ast.Attribute) and value.attr == "kind")
    aliases = {name for name, value in assigned if names_an_objective(value, set(), kinds)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            hit = any(names_an_objective(side, aliases, kinds) for side in (node.left, *node.comparators))
        elif isinstance(node, ast.Match):
            hit = names_an_objective(node.subject, aliases, kinds)
        elif isinstance(node, ast.Subscript):
            hit = names_an_objective(node.slice, aliases, kinds)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            hit = any(names_an_objective(arg, aliases, kinds) for arg in node.args[:1])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance",
                                                                                                "issubclass"):
            checked = node.args[1] if len(node.args) > 1 else None
            named = checked.elts if isinstance(checked, ast.Tuple) else [checked]
            hit = any(isinstance(n, ast.Name) and n.id in classes for n in named)
        else:
            hit = False
        if hit:
            lines.append(getattr(node, "lineno", 0))
    return lines


def test_objectives_are_told_apart_in_the_table_and_validation_only():
    """No module but the table, validation and the data reader's choice tells objectives apart: by comparing a name
    or a kind's field, through a local alias, `match`, a dict lookup, or isinstance on an objective's class."""
    from typing import get_args

    from qlora_fsdp.config.objectives import OBJECTIVES, ObjectiveName
    from qlora_fsdp.objectives.table import OBJECTIVE_CLASSES

    assert set(OBJECTIVES) == set(get_args(ObjectiveName)) == set(OBJECTIVE_CLASSES)
    classes = objective_subclasses()
    assert {"Supervised", "Dft", "Grpo", "Rloo", "Dpo", "Kto", "KtoLoss", "DpoLoss"} <= classes
    found = [f"{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             if str(path.relative_to(PACKAGE)) not in DISPATCH_ALLOWED
             for line in dispatches(ast.parse(path.read_text()), classes)]
    assert found == [], "ask the objective (a method or field of its class) instead"
    # the planner and the loop do not even read the kind: what they need, the objective offers
    reading = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for folder in ("plan", "training")
               for path in sorted((PACKAGE / folder).glob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Attribute) and node.attr == "kind"]
    assert reading == [], "the planner and the loop ask the objective (objectives/base.py), not cfg.train.kind"


def objective_section_reads(tree: ast.AST) -> list[int]:
    """Lines reading a generating objective's own section (`x.grpo`, `x.rloo`)."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in ("grpo", "rloo")]


def test_a_generating_objectives_settings_are_read_in_objectives_and_config_only():
    """GRPO's and RLOO's own sections are theirs: the planner, the run, the data and the studio read the generation
    plan (generation/plan.py) or an objective's method; the guard catches a read."""
    assert objective_section_reads(ast.parse("rows = cfg.grpo.num_iterations")) == [1]
    assert objective_section_reads(ast.parse("rows = cfg.generation.rows")) == []
    found = [f"{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.relative_to(PACKAGE).parts[0] not in ("objectives", "config")
             for line in objective_section_reads(ast.parse(path.read_text()))]
    assert found == [], "read the generation plan or ask the objective"


MUTATORS = {"append", "add", "clear", "extend", "insert", "pop", "popitem", "remove", "setdefault", "update"}
CACHED_FOLDERS = ("plan", "measure", "run")  # the planner's: what a plan works out is kept by the plan's caller


def module_caches(tree: ast.Module) -> list[str]:
    """Module-level names a function mutates (a dict filled as a cache, a `global` rebound) and functions memoized
    with functools.cache or lru_cache: state a module keeps between calls."""
    names = {target.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
             if isinstance(target, ast.Name)}
    found = []
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for decorator in function.decorator_list:
            called = decorator.func if isinstance(decorator, ast.Call) else decorator
            if ast.unparse(called).split(".")[-1] in ("cache", "lru_cache"):
                found.append(f"{function.name} (memoized)")
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                found += [f"{name} (global)" for name in node.names]
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                found += [f"{t.value.id} (item set)" for t in targets
                          if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in names]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                  and isinstance(node.func.value, ast.Name) and node.func.value.id in names):
                found.append(f"{node.func.value.id} ({node.func.attr})")
    return found


def test_the_planner_keeps_no_cache_of_its_own():
    """plan/, measure/ and run/ keep nothing between calls in module state: a plan's caller owns what it measured
    (measure/planning.py), keyed by what the measurement reads; the guard catches each form of a module's cache."""
    forms = {"item set": "KEPT = {}\ndef f(k):\n    KEPT[k] = 1", "update": "KEPT = {}\ndef f():\n    KEPT.update(a=1)",
             "global": "N = 0\ndef f():\n    global N\n    N = 1", "lru_cache": "@functools.lru_cache\ndef f(): pass",
             "cache": "@cache\ndef f(): pass"}
    for form, code in forms.items():
        assert module_caches(ast.parse(code)), form
    assert module_caches(ast.parse("WORDS = {}\ndef f(planning):\n    planning.steps['k'] = WORDS.get('k')")) == []
    paths = [path for folder in CACHED_FOLDERS for path in sorted((PACKAGE / folder).rglob("*.py"))]
    found = [f"{path.relative_to(PACKAGE)}: {what}" for path in paths
             for what in module_caches(ast.parse(path.read_text()))]
    assert found == [], "keep it in the caller's Planning (measure/planning.py)"


DISPATCH_FORMS = {
    "compare": 'if cfg.train.objective == "dpo":\n    pass',
    "alias": 'name = cfg.train.objective\nif name in ("dpo", "kto"):\n    pass',
    "match": 'match cfg.train.objective:\n    case "grpo":\n        pass',
    "dict get": 'extra = {"dpo": 1}.get(cfg.train.objective, 0)',
    "subscript": 'extra = {"dpo": 1}[cfg.train.objective]',
    "isinstance": 'if isinstance(loss, KtoLoss):\n    pass',
    "kind field": 'if cfg.train.kind.data == "prompts":\n    pass',
    "kind alias": 'kind = cfg.train.kind\nread = {"prompts": 1}[kind.data]',
}


def test_the_dispatch_guard_catches_every_form():
    """Each way of telling objectives apart is caught; an objective's own method call is not."""
    classes = objective_subclasses()
    for form, code in DISPATCH_FORMS.items():
        assert dispatches(ast.parse(code), classes), form
    fine = "objective = planned_objective(cfg)\nmade = objective.planned_generation()\nif made is None:\n    pass"
    assert dispatches(ast.parse(fine), classes) == []
