"""loss_curves.png: the loss panel, then a panel for each metric the run's objective names in its start record
(SFT none; DPO reward accuracy and margin; GRPO reward and KL; KTO KL and its held-out rewards); the studio's curves
group the same metrics."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

from qlora_fsdp.outputs.plots import metric_panels, objective_metrics, plot_loss_curves, read_series


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


def write_metrics(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def start_of(objective: str) -> dict:
    """The start record a run of `objective` writes (api.py): its objective's metric names."""
    from qlora_fsdp.config import Config
    from qlora_fsdp.objectives.table import objective_class

    cfg = Config()
    cfg.train.objective = objective  # type: ignore[assignment]
    kind = objective_class(cfg)
    return {"event": "start", "metrics": {"progress": list(kind.PROGRESS_METRICS), "eval": list(kind.EVAL_METRICS)}}


def test_sft_has_one_panel_and_every_objective_adds_its_metrics(tmp_path):
    sft = [start_of("sft"), *({"step": s, "loss": 3.0 - 0.1 * s} for s in range(1, 11)),
           {"step": 10, "eval_loss": 2.5}, {"step": 11, "loss": float("nan"), "skipped": True}]
    dpo = [start_of("dpo"), {"step": 0, "eval_loss": 0.693, "eval_reward_accuracy": 0.5, "eval_reward_margin": 0.0},
           *({"step": s, "loss": 0.69 - 0.05 * s, "reward_accuracy": 0.5 + 0.04 * s, "reward_margin": 0.1 * s}
             for s in range(1, 11)),
           {"step": 10, "eval_loss": 0.2, "eval_reward_accuracy": 0.95, "eval_reward_margin": 1.3}]
    sft_png = plot_loss_curves(write_metrics(tmp_path / "sft" / "metrics.jsonl", sft), tmp_path / "sft.png")
    dpo_png = plot_loss_curves(write_metrics(tmp_path / "dpo" / "metrics.jsonl", dpo), tmp_path / "dpo.png")
    assert sft_png is not None and dpo_png is not None
    assert png_size(sft_png) == (800, 450) and png_size(dpo_png) == (800, 1050)  # 8 x 4.5 in, + 3 in a metric
    series = read_series(tmp_path / "dpo" / "metrics.jsonl", ("loss", "eval_reward_accuracy"))
    assert series["eval_reward_accuracy"] == [(0, 0.5), (10, 0.95)] and len(series["loss"]) == 10
    assert len(read_series(tmp_path / "sft" / "metrics.jsonl", ("loss",))["loss"]) == 10  # the skipped step is out
    assert plot_loss_curves(write_metrics(tmp_path / "empty" / "metrics.jsonl", [{"event": "start"}]),
                            tmp_path / "none.png") is None


def test_no_matplotlib_means_no_png_and_no_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    metrics = write_metrics(tmp_path / "sft" / "metrics.jsonl", [{"step": 1, "loss": 2.0}])
    assert plot_loss_curves(metrics, tmp_path / "sft.png") is None and not (tmp_path / "sft.png").exists()


def test_grpo_rloo_and_kto_runs_plot_what_their_objectives_log(tmp_path):
    """GRPO's and RLOO's reward (with its held-out twin) and KL, KTO's KL and held-out rewards: a panel each in
    loss_curves.png and in the studio's curves, named by the start record, not by a list in the plotters."""
    from qlora_fsdp.studio.live import curves
    from qlora_fsdp.studio.pictures import curves_figure

    steps = [{"step": s, "loss": 0.1, "reward": 0.1 * s, "kl": 0.01 * s, "tokens_per_s": 9.0} for s in (1, 2, 3)]
    grpo = [start_of("grpo"), {"step": 0, "eval_reward": 0.0}, *steps, {"step": 3, "eval_reward": 0.4}]
    assert objective_metrics(grpo) == (("reward", "kl"), ("eval_reward",))
    assert metric_panels(*objective_metrics(grpo)) == [("reward", ("reward", "eval_reward")), ("kl", ("kl",))]
    for objective in ("grpo", "rloo"):
        records = [start_of(objective), *grpo[1:]]
        png = plot_loss_curves(write_metrics(tmp_path / objective / "metrics.jsonl", records), tmp_path / "g.png")
        assert png is not None and png_size(png) == (800, 1050)  # loss, reward, kl
        figure = curves_figure(curves(records))
        assert [ax.get_title() for ax in figure.axes if ax.get_visible()] == ["loss", "reward", "kl", "tokens/s"]
    kto = [start_of("kto"), {"step": 1, "loss": 0.5, "kl": 0.2}, {"step": 1, "eval_loss": 0.4,
                                                                   "eval_rewards_desirable": 0.3}]
    assert [title for title, _ in metric_panels(*objective_metrics(kto))] == [
        "kl", "eval_rewards_desirable", "eval_rewards_undesirable"]
    figure = curves_figure(curves(kto))
    assert [ax.get_title() for ax in figure.axes if ax.get_visible()] == ["loss", "kl", "eval_rewards_desirable"]
    assert objective_metrics([{"event": "start"}]) == ((), ())  # a run written before the record named them
