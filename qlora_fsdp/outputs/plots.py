"""loss_curves.png from metrics.jsonl: training loss (and its running mean) and held-out loss against step; for
preference pairs a second panel of reward accuracy and margin, in training and held out."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

Series = list[tuple[int, float]]


def complete_records(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a JSONL file a run appends to (metrics.jsonl, completions.jsonl), up to the last complete
    line: a line still being written, or one cut short by a kill (the run trims it when it resumes), is left out."""
    if not path.is_file():
        return []
    text = path.read_text(errors="replace")
    records = []
    for line in text[:text.rfind("\n") + 1].splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def series_of(records: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Series]:
    """(step, value) for each key, from the step records that hold it finite; a skipped step's are left out, and a
    step logged twice keeps its latest value."""
    series: dict[str, dict[int, float]] = {key: {} for key in keys}
    for record in records:
        if "event" in record or record.get("skipped") or "step" not in record:
            continue
        for key in keys:
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                series[key][int(record["step"])] = float(value)
    return {key: sorted(points.items()) for key, points in series.items()}


def read_series(metrics: Path, keys: tuple[str, ...]) -> dict[str, Series]:
    return series_of(complete_records(metrics), keys)


def running_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_training(ax: Any, points: Series, color: str, label: str) -> None:
    """The raw values faint, their running mean over a twentieth of the run solid."""
    steps, values = zip(*points, strict=True)
    ax.plot(steps, values, color=color, alpha=0.3, linewidth=1)
    window = max(1, len(values) // 20)
    ax.plot(steps, running_mean(list(values), window), color=color, label=f"{label}, mean of {window}")


def plot_held_out(ax: Any, points: Series, color: str, label: str) -> None:
    steps, values = zip(*points, strict=True)
    ax.plot(steps, values, "o-", color=color, label=label)


REWARD_KEYS = ("reward_accuracy", "eval_reward_accuracy", "reward_margin", "eval_reward_margin")


def plot_loss_curves(metrics: Path, png: Path) -> Path | None:
    """Write the PNG; None when there is nothing to plot yet, or no matplotlib (an offline GPU machine's carried
    wheels leave it out: the run's metrics.jsonl holds every figure)."""
    series = read_series(metrics, ("loss", "eval_loss", *REWARD_KEYS))
    if not series["loss"] and not series["eval_loss"]:
        return None
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")  # files only: no display needed on a cluster node
    import matplotlib.pyplot as plt

    pairs = bool(series["reward_accuracy"] or series["eval_reward_accuracy"])
    fig, axes = plt.subplots(2 if pairs else 1, 1, figsize=(8, 8 if pairs else 4.5), dpi=100, squeeze=False)
    loss_ax = axes[0][0]
    if series["loss"]:
        plot_training(loss_ax, series["loss"], "tab:blue", "training loss")
    if series["eval_loss"]:
        plot_held_out(loss_ax, series["eval_loss"], "tab:orange", "held-out loss")
    loss_ax.set(xlabel="optimizer step", ylabel="loss (per pair)" if pairs else "loss (per target token)",
                title=metrics.parent.name)
    loss_ax.grid(alpha=0.3)
    loss_ax.legend()
    if pairs:
        plot_rewards(axes[1][0], series)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return png


def plot_rewards(ax: Any, series: dict[str, Series]) -> None:
    """Reward accuracy (left axis) and margin (right axis): training's running mean, held-out points."""
    for key, color, label in (("reward_accuracy", "tab:green", "training reward accuracy"),
                              ("eval_reward_accuracy", "tab:red", "held-out reward accuracy")):
        if series[key]:
            (plot_training if key == "reward_accuracy" else plot_held_out)(ax, series[key], color, label)
    ax.set(xlabel="optimizer step", ylabel="reward accuracy (ties count half)", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="center right")
    margin_ax = ax.twinx()
    for key, style, label in (("reward_margin", "-", "training reward margin"),
                              ("eval_reward_margin", "s--", "held-out reward margin")):
        if series[key]:
            steps, values = zip(*series[key], strict=True)
            margin_ax.plot(steps, values, style, color="tab:purple", alpha=0.6, linewidth=1, label=label)
    margin_ax.set(ylabel="reward margin (chosen - rejected)")
    if series["reward_margin"] or series["eval_reward_margin"]:
        margin_ax.legend(loc="lower right")
