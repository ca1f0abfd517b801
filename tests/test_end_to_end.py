"""The real entry points: torchrun with 2 ranks (the demo), torchrun with 1, plain python, folder safety."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def eval_losses(out_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in records if "eval_loss" in r]


def test_demo_recipe_learns(tmp_path, demo_model_dir):
    """The tiny_cpu recipe as `make demo` runs it, for 60 of its 150 steps: held-out loss falls by 30% or more."""
    out = tmp_path / "demo"
    result = run([TORCHRUN, "--nproc_per_node", "2", "train.py", "--recipe", "tiny_cpu",
                  f"model.path={demo_model_dir}", f"train.output_dir={out}", "train.max_steps=60"], timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = eval_losses(out)
    assert losses[-1] <= 0.7 * losses[0], losses
    assert "tokens_per_s" in result.stdout and (out / "adapter" / "adapter_model.safetensors").is_file()


def test_plain_python_and_single_rank_torchrun(tmp_path, tiny_model_dir):
    common = [f"model.path={tiny_model_dir}", "train.max_steps=3", "data.eval_samples=8"]
    plain = run([sys.executable, "train.py", "--recipe", "tiny_cpu", *common,
                 f"train.output_dir={tmp_path / 'plain'}"], timeout=200)
    assert plain.returncode == 0, plain.stderr[-3000:]
    single = run([TORCHRUN, "--nproc_per_node", "1", "train.py", "--recipe", "tiny_cpu", *common,
                  f"train.output_dir={tmp_path / 'single'}"], timeout=200)
    assert single.returncode == 0, single.stderr[-3000:]
    # same world size, same seed, same data: the same run
    assert eval_losses(tmp_path / "plain") == eval_losses(tmp_path / "single")


def test_existing_output_folder_is_refused(tmp_path, tiny_model_dir):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    result = run([sys.executable, "train.py", "--recipe", "tiny_cpu", f"model.path={tiny_model_dir}",
                  f"train.output_dir={out}"], timeout=200)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: output folder {out} already exists")
    assert (out / "precious.txt").read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == ["precious.txt"]
