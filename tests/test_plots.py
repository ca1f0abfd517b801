"""loss_curves.png: the loss panel for SFT; for preference pairs a second panel with reward accuracy and margin."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

from qlora_fsdp.outputs.plots import plot_loss_curves, read_series


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


def write_metrics(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_sft_has_one_panel_and_pairs_add_the_rewards(tmp_path):
    sft = [{"event": "start"}, *({"step": s, "loss": 3.0 - 0.1 * s} for s in range(1, 11)),
           {"step": 10, "eval_loss": 2.5}, {"step": 11, "loss": float("nan"), "skipped": True}]
    dpo = [{"step": 0, "eval_loss": 0.693, "eval_reward_accuracy": 0.5, "eval_reward_margin": 0.0},
           *({"step": s, "loss": 0.69 - 0.05 * s, "reward_accuracy": 0.5 + 0.04 * s, "reward_margin": 0.1 * s}
             for s in range(1, 11)),
           {"step": 10, "eval_loss": 0.2, "eval_reward_accuracy": 0.95, "eval_reward_margin": 1.3}]
    sft_png = plot_loss_curves(write_metrics(tmp_path / "sft" / "metrics.jsonl", sft), tmp_path / "sft.png")
    dpo_png = plot_loss_curves(write_metrics(tmp_path / "dpo" / "metrics.jsonl", dpo), tmp_path / "dpo.png")
    assert sft_png is not None and dpo_png is not None
    assert png_size(sft_png) == (800, 450) and png_size(dpo_png) == (800, 800)  # 8 x 4.5 in, 8 x 8 in at 100 dpi
    series = read_series(tmp_path / "dpo" / "metrics.jsonl", ("loss", "eval_reward_accuracy"))
    assert series["eval_reward_accuracy"] == [(0, 0.5), (10, 0.95)] and len(series["loss"]) == 10
    assert len(read_series(tmp_path / "sft" / "metrics.jsonl", ("loss",))["loss"]) == 10  # the skipped step is out
    assert plot_loss_curves(write_metrics(tmp_path / "empty" / "metrics.jsonl", [{"event": "start"}]),
                            tmp_path / "none.png") is None


def test_no_matplotlib_means_no_png_and_no_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    metrics = write_metrics(tmp_path / "sft" / "metrics.jsonl", [{"step": 1, "loss": 2.0}])
    assert plot_loss_curves(metrics, tmp_path / "sft.png") is None and not (tmp_path / "sft.png").exists()
