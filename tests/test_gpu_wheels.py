"""An offline GPU machine with only torch: the folder `make gpu-wheels` writes, and its install for the GPU check."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests import gpu_check, gpu_site
from tests.helpers import REPO


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_wheels = load_script("gpu_wheels")


def test_the_folder_holds_the_pins_less_torch_and_what_an_image_has():
    """The package's pins and what they need, at the installed versions; never torch or what torch needs, the
    studio's, the scientific base (unless --full), or what only hf-xet and typer need."""
    wanted = dict(line.split("==") for line in gpu_wheels.wanted("3.12", full=False))
    for line in (REPO / "requirements.txt").read_text().splitlines():
        if line and not line.startswith(("#", "torch", "gradio", "pillow", "matplotlib")):
            name, version = line.split("==")
            assert wanted.pop(name.lower()) == version, name
    assert {"dill", "multiprocess", "xxhash", "psutil"} <= wanted.keys()  # datasets' and peft's own needs
    brought = set(gpu_wheels.wanted("3.12", full=False))
    names = {line.split("==")[0] for line in brought}
    assert not names & {"torch", "sympy", "jinja2", "filelock", "fsspec", "networkx", "nvidia-nccl-cu13", "gradio"}
    assert not names & ({"numpy", "pandas", "pyarrow", "matplotlib", "hf-xet", "typer", "rich", "pydantic"})
    full = {line.split("==")[0] for line in gpu_wheels.wanted("3.12", full=True)}
    assert {"numpy", "pandas", "pyarrow", "matplotlib"} <= full and not full & {"torch", "hf-xet", "typer"}


def fake_wheel(path: Path, files: dict[str, bytes]) -> Path:
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in files.items())
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr("bitsandbytes-0.50.2.dist-info/RECORD", record + "bitsandbytes-0.50.2.dist-info/RECORD,,\n")
    return path


def test_bitsandbytes_keeps_one_cuda_runtime_and_the_cpu_library(tmp_path):
    files = {f"bitsandbytes/libbitsandbytes_{kind}.so": kind.encode() * 100
             for kind in ("cpu", "cuda128", "cuda130", "rocm70", "xpu2026")}
    wheel = fake_wheel(tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl",
                       {**files, "bitsandbytes/__init__.py": b"x = 1\n"})
    gpu_wheels.trim_bitsandbytes(wheel, "13.0")
    with zipfile.ZipFile(wheel) as trimmed:
        names = set(trimmed.namelist())
        record = trimmed.read("bitsandbytes-0.50.2.dist-info/RECORD").decode()
        assert trimmed.read("bitsandbytes/libbitsandbytes_cuda130.so") == b"cuda130" * 100
    assert {n for n in names if ".so" in n} == {"bitsandbytes/libbitsandbytes_cpu.so",
                                                "bitsandbytes/libbitsandbytes_cuda130.so"}
    assert "cuda128" not in record and "cuda130" in record and "__init__.py" in record
    with pytest.raises(SystemExit, match=r"no library for CUDA 12\.6"):
        gpu_wheels.trim_bitsandbytes(wheel, "12.6")


def installable_wheel(folder: Path) -> Path:
    """A real (tiny) wheel pip installs: one module."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = "carried_probe-1.0.dist-info"
    files = {"carried_probe.py": b"VALUE = 42\n",
             f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: carried-probe\nVersion: 1.0\n",
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = folder / "carried_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{dist}/RECORD", "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n")
    return path


@pytest.mark.slow
def test_carried_wheels_install_into_their_own_folder_once(tmp_path):
    """pip puts them in the site folder only (the environment's packages untouched); the same wheels again install
    nothing; the probe sees them through the environment the checks get, and a missing module is one line."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    installable_wheel(wheels)
    gpu_site.install(wheels, site)
    assert (site / "carried_probe.py").is_file()
    stamp = (site / ".wheels").stat().st_mtime_ns
    gpu_site.install(wheels, site)
    assert (site / ".wheels").stat().st_mtime_ns == stamp
    env = gpu_site.environment(site)
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(site), str(REPO)]
    assert gpu_site.missing(env, probe="import carried_probe; assert carried_probe.VALUE == 42") is None
    done = subprocess.run([sys.executable, "-c", "import carried_probe"], capture_output=True, env=dict(os.environ))
    assert done.returncode != 0  # not in this environment's own packages
    line = gpu_site.missing(env, probe="import carried_probe, not_carried_anywhere")
    assert line is not None and "No module named 'not_carried_anywhere'" in line and "\n" not in line
    with pytest.raises(SystemExit, match="no wheels in"):
        gpu_site.install(tmp_path / "empty", site)


def test_wheels_option_is_dropped_before_the_checks_run():
    argv = ["--wheels", "w", "--only", "nan_canary", "--wheels=x", "--dry-run", "--total-seconds", "300"]
    assert gpu_check.without_option(argv, "--wheels") == ["--only", "nan_canary", "--dry-run", "--total-seconds",
                                                          "300"]
