"""The repo is an installed package: one list of pins, and no script or test finds code through sys.path edits."""

from __future__ import annotations

import ast
import importlib.metadata
import tomllib

from tests.helpers import REPO


def python_files(*folders: str) -> list:
    return sorted(path for folder in folders for path in (REPO / folder).glob("*.py"))


def test_pyproject_pins_exactly_the_requirements():
    """pip reads requirements.txt (the Makefile installs it, then the package with --no-deps) and an installer
    of the package reads pyproject.toml: they must not drift apart."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = (REPO / "requirements.txt").read_text().splitlines()
    requirements = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    assert project["dependencies"] == requirements


def test_the_package_is_installed_from_this_checkout():
    assert importlib.metadata.version("qlora-fsdp")
    import qlora_fsdp

    assert qlora_fsdp.__file__.startswith(str(REPO / "qlora_fsdp"))  # editable: recipes/ etc. sit beside it


def edits_sys_path(path) -> bool:
    """Whether the file calls a method of `sys.path` (insert, append, extend, ...) or assigns to it."""
    def is_sys_path(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            return True
        if isinstance(node, ast.Assign) and any(is_sys_path(target) for target in node.targets):
            return True
    return False


def test_no_sys_path_edits_in_the_repo():
    files = python_files("scripts", "tests", ".") + sorted((REPO / "qlora_fsdp").rglob("*.py"))
    assert len(files) > 30
    assert [path.name for path in files if edits_sys_path(path)] == []


def imported_modules(path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    return {name.split(".")[0] for name in names}


def test_tests_import_nothing_from_scripts():
    """What a test shares with a script lives in the package (e.g. qlora_fsdp.tools.tiny_model). Tests of a
    script's own command line load that file by path (test_gpu_check, test_merge_generate), which is no import."""
    scripts = {path.stem for path in python_files("scripts")} | {"train"}
    found = {path.name: imported_modules(path) & scripts for path in python_files("tests")}
    assert {name: modules for name, modules in found.items() if modules} == {}


def test_scripts_import_nothing_from_tests_or_train_py():
    """A script run as `python scripts/x.py` has scripts/ on its path, not the checkout: what it shares with the
    tests or train.py must come from the package (sibling scripts, e.g. gpu_check for gpu_check_cases, are fine)."""
    found = {path.name: imported_modules(path) & {"tests", "train"} for path in python_files("scripts")}
    assert {name: modules for name, modules in found.items() if modules} == {}
