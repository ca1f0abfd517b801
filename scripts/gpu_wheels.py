"""A folder of wheels for a GPU machine that has torch but no package index: `make gpu-wheels`.

    python scripts/gpu_wheels.py --out gpu-wheels                  # Python 3.12, CUDA 13.0 (torch 2.11+'s default)
    python scripts/gpu_wheels.py --out gpu-wheels --cuda 12.8 --python 3.11
    python scripts/gpu_wheels.py --out gpu-wheels --full          # also numpy, pandas, pyarrow, matplotlib

Run it where a package index is reachable, carry the folder over, and there run
`python -m tests.gpu_check --wheels gpu-wheels` (or `make gpu-check WHEELS=gpu-wheels`): it installs them into a
folder of its own, never touching the machine's packages.

What is brought: the pinned versions of requirements.txt (torch and the studio's gradio and pillow aside) and
everything they need, less what torch itself needs (the machine has torch) and, unless --full, less the scientific
base every GPU image has (numpy, pandas, pyarrow, matplotlib and theirs): that is what would blow the folder past
30 MB. Two declared needs are left out with what only they need: hf-xet (downloads from the hub; the box is offline)
and typer (transformers' own command line). bitsandbytes' wheel carries a library per CUDA runtime (43 MB); the
folder keeps the target runtime's and the CPU one. Dependencies are read from this environment's installed
metadata (the pins are installed here), markers evaluated for the target Python on Linux x86_64; each wheel is then
downloaded alone for that platform.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
NOT_BROUGHT = {"torch", "gradio", "pillow"}  # the machine's own; the studio is not run on a GPU box
SCIENTIFIC_BASE = {"numpy", "pandas", "pyarrow", "matplotlib", "contourpy", "cycler", "fonttools", "kiwisolver",
                   "pillow", "pyparsing", "python-dateutil", "six", "tzdata"}
# declared needs that an offline box running the checks never imports, nor anything only they need
NEVER_IMPORTED = {"hf-xet": "huggingface-hub's downloads from the hub", "typer": "transformers' own command line"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "linux_x86_64", "any")
LIMIT_BYTES = 30 * 2**20


def marker_environment(python: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def closure(names: Iterable[str], python: str, pruned: frozenset[str] = frozenset()) -> set[str]:
    """The distributions `names` need, themselves included, from the installed metadata; `pruned` ones are not
    followed."""
    env, seen, todo = marker_environment(python), set[str](), [str(canonicalize_name(n)) for n in names]
    while todo:
        name = todo.pop()
        if name in seen or name in pruned:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(env):
                todo.append(str(canonicalize_name(requirement.name)))
    return seen


def pinned_requirements() -> list[str]:
    lines = (REPO / "requirements.txt").read_text().splitlines()
    return [line.split("==")[0] for line in lines if line.strip() and not line.startswith("#")]


def wanted(python: str, full: bool) -> list[str]:
    """`name==version` of every distribution to bring, at the versions installed here (the pins)."""
    brought = {canonicalize_name(n) for n in pinned_requirements()} - NOT_BROUGHT
    names = closure(brought, python, frozenset(NEVER_IMPORTED)) - closure({"torch"}, python) - NOT_BROUGHT
    if not full:
        names -= SCIENTIFIC_BASE
    return sorted(f"{name}=={metadata.version(name)}" for name in names)


def download(requirements: list[str], out: Path, python: str) -> None:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, *platforms, "--dest", str(out), *requirements], check=True)


def trim_bitsandbytes(wheel: Path, cuda: str) -> None:
    """Keep one CUDA runtime's library (and the CPU one) in bitsandbytes' wheel; RECORD rewritten to match."""
    runtime = f"libbitsandbytes_cuda{cuda.replace('.', '')}.so"
    keep = {runtime, "libbitsandbytes_cpu.so"}
    with zipfile.ZipFile(wheel) as source:
        libraries = [n for n in source.namelist() if Path(n).name.startswith("libbitsandbytes_")]
    if runtime not in {Path(n).name for n in libraries}:
        shipped = sorted(Path(n).name for n in libraries)
        raise SystemExit(f"bitsandbytes has no library for CUDA {cuda}: it ships {', '.join(shipped)}")
    trimmed = wheel.with_suffix(".trimmed")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as target:
        dropped = {n for n in libraries if Path(n).name not in keep}
        for item in source.infolist():
            if item.filename in dropped:
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if line.split(",")[0] not in dropped) + "\n").encode()
            target.writestr(item, data)
    trimmed.replace(wheel)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "gpu-wheels")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor)")
    parser.add_argument("--cuda", default="13.0", help="the CUDA runtime of its torch (torch.version.cuda)")
    parser.add_argument("--full", action="store_true", help="also the scientific base (numpy, pandas, pyarrow, ...)")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} is not empty: remove it, or pass another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    requirements = wanted(args.python, args.full)
    download(requirements, args.out, args.python)
    for wheel in args.out.glob("bitsandbytes-*.whl"):
        trim_bitsandbytes(wheel, args.cuda)
    sizes = {wheel.name: wheel.stat().st_size for wheel in sorted(args.out.glob("*.whl"))}
    for name, size in sorted(sizes.items(), key=lambda item: -item[1]):
        print(f"{size / 2**20:7.2f} MB  {name}")
    total = sum(sizes.values())
    print(f"{total / 2**20:7.2f} MB  in {len(sizes)} wheels, {args.out} (Python {args.python}, CUDA {args.cuda})")
    if total > LIMIT_BYTES and not args.full:
        print(f"over the {LIMIT_BYTES // 2**20} MB a carried folder should hold", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
