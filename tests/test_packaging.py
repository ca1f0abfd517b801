"""The repo is an installed package: one list of pins, and no script or test finds code through sys.path edits."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.helpers import REPO


def python_files(*folders: str) -> list:
    return sorted(path for folder in folders for path in (REPO / folder).glob("*.py"))


def requirement_lines(name: str) -> list[str]:
    lines = (REPO / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith(("#", "-r "))]


TORCH_RANGE = "torch>=2.11,<2.14"


def test_pyproject_pins_exactly_the_requirements():
    """pip reads the requirements files and an installer of the package reads pyproject.toml: what the package runs
    with (requirements.txt, `dependencies`) and the test and lint tools (requirements-dev.txt, the `dev` extra) must
    not drift apart."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pinned = requirement_lines("requirements.txt")
    # torch alone is a range in the package (the releases GPU machines ship), its pin in requirements.txt inside it
    assert project["dependencies"] == [TORCH_RANGE if line.startswith("torch==") else line for line in pinned]
    assert pinned[0] == "torch==2.13.0" and SpecifierSet(TORCH_RANGE[len("torch"):]).contains("2.13.0")
    assert project["optional-dependencies"]["dev"] == requirement_lines("requirements-dev.txt")
    assert "-r requirements.txt" in (REPO / "requirements-dev.txt").read_text().splitlines()


# imported by the package only where a test model is made (qlora_fsdp.tools.real_model reads GGUF files through
# transformers, and says so in one line when the package is missing): a dev requirement. Triton: CUDA builds of torch
# ship it (the GPU kernels' home); the CPU build does not, and the tests run the kernels in its interpreter
DEV_ONLY_IMPORTS = {"gguf", "triton"}
# imported only by tools/lora_gguf_writer.py, which runs under llama.cpp's converter in a folder of its own
# (requirements-gguf.txt), never in the package's interpreter
CONVERTER_IMPORTS = {"conversion"}
TOOLS = {"pytest", "ruff", "mypy", "trl", "psutil", "pytest-timeout"}


def third_party_imports(folder: str) -> set[str]:
    found: set[str] = set()
    for path in (REPO / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name != folder}


def distribution(requirement: str) -> str:
    return requirement.split("==")[0].lower().replace("_", "-")


def test_runtime_dependencies_are_what_the_package_imports():
    """Every module the package imports comes with a runtime requirement (the test tools do not: they are the `dev`
    extra), and every runtime requirement is imported (torch's CPU build aside, nothing rides along)."""
    runtime = {distribution(line) for line in requirement_lines("requirements.txt")}
    modules = third_party_imports("qlora_fsdp") - DEV_ONLY_IMPORTS - CONVERTER_IMPORTS
    providers = importlib.metadata.packages_distributions()
    needed = {distribution(providers[module][0]) for module in modules}
    assert needed == runtime
    assert not runtime & TOOLS


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


COMMANDS = ("qlora-train", "qlora-plan", "qlora-merge", "qlora-generate", "qlora-export", "qlora-studio")


def fresh_environment(path) -> tuple:
    """A new virtual environment with only the package installed, editable (its recipes/ beside it); it sees the
    dependencies already installed here through a path file, as a machine that installed them would."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    here = [p for p in sys.path if p.endswith("site-packages")][0]
    (Path(site) / "dependencies.pth").write_text(here + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "-e", str(REPO)], check=True)
    return python, path / "bin"


@pytest.mark.slow
def test_console_commands_run_installed_in_a_fresh_environment(tmp_path):
    python, bin_dir = fresh_environment(tmp_path / "env")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}
    for command in COMMANDS:  # each installed, each answers --help
        done = subprocess.run([bin_dir / command, "--help"], capture_output=True, text=True, env=env)
        assert done.returncode == 0 and "usage:" in done.stdout, (command, done.stderr[-2000:])
    # a real plan and a resolved config, from another folder: the installed package finds its recipes and configs
    done = subprocess.run([bin_dir / "qlora-plan", "--recipe", "qwen2.5_7b_1x24gb"], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert done.returncode == 0 and "FITS" in done.stdout, done.stderr[-2000:]
    done = subprocess.run([bin_dir / "qlora-train", "--recipe", "tiny_cpu", "--print-config"], capture_output=True,
                          text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0 and "paged_adamw_8bit" in done.stdout, done.stderr[-2000:]
    # installed by itself, the package asks for what it runs with, and the test tools only through the extra
    script = "import importlib.metadata as m; print('\\n'.join(m.requires('qlora-fsdp')))"
    requires = subprocess.run([python, "-c", script], capture_output=True, text=True, check=True,
                              cwd=tmp_path).stdout.splitlines()  # not the checkout, which may hold a built egg-info
    torch_line = next(Requirement(line) for line in requires if Requirement(line).name == "torch")
    assert torch_line.specifier == SpecifierSet(TORCH_RANGE[len("torch"):])  # pip writes it as "torch<2.14,>=2.11"
    assert any('extra == "dev"' in line for line in requires)
    assert [line for line in requires if line.split("==")[0] in TOOLS and 'extra == "dev"' not in line] == []
