"""loss_curves.png from metrics.jsonl: training loss (and its running mean) and held-out loss against step, then a
panel for each metric the run's objective names in its start record (objectives/base.py's PROGRESS_METRICS and
EVAL_METRICS), in training and held out. The studio's curves group them alike (studio/pictures.py)."""

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


def objective_metrics(records: list[dict[str, Any]]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The objective's progress and held-out metric names, as the run's start record names them (none in a run
    written before the record held them)."""
    start = next((r for r in records if r.get("event") == "start"), {})
    named = start.get("metrics") or {}
    return tuple(named.get("progress", ())), tuple(named.get("eval", ()))


def metric_panels(progress: tuple[str, ...], evals: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """A panel a metric: its training values with their held-out twin (`eval_<name>`), then the held-out metrics
    without one; eval_loss and eval_ppl belong to the loss."""
    panels: list[tuple[str, tuple[str, ...]]] = [
        (name, (name, f"eval_{name}") if f"eval_{name}" in evals else (name,)) for name in progress]
    twins = {f"eval_{name}" for name in progress} | {"eval_loss", "eval_ppl"}
    return panels + [(name, (name,)) for name in evals if name not in twins]


def plot_loss_curves(metrics: Path, png: Path) -> Path | None:
    """Write the PNG: the loss, then a panel for each of the objective's metrics the run logged (GRPO's reward and
    KL, DPO's reward accuracy and margin, ...); None when there is nothing to plot yet, or no matplotlib (an offline
    GPU machine's carried wheels leave it out: the run's metrics.jsonl holds every figure)."""
    records = complete_records(metrics)
    wanted = metric_panels(*objective_metrics(records))
    series = series_of(records, ("loss", "eval_loss", *(key for _, keys in wanted for key in keys)))
    if not series["loss"] and not series["eval_loss"]:
        return None
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")  # files only: no display needed on a cluster node
    import matplotlib.pyplot as plt

    panels = [(title, keys) for title, keys in wanted if any(series[key] for key in keys)]
    fig, axes = plt.subplots(1 + len(panels), 1, figsize=(8, 4.5 + 3 * len(panels)), dpi=100, squeeze=False)
    loss_ax = axes[0][0]
    if series["loss"]:
        plot_training(loss_ax, series["loss"], "tab:blue", "training loss")
    if series["eval_loss"]:
        plot_held_out(loss_ax, series["eval_loss"], "tab:orange", "held-out loss")
    loss_ax.set(xlabel="optimizer step", ylabel="loss", title=metrics.parent.name)
    loss_ax.grid(alpha=0.3)
    loss_ax.legend()
    for (title, keys), row in zip(panels, axes[1:], strict=True):
        plot_metric(row[0], title, keys, series)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return png


def plot_metric(ax: Any, title: str, keys: tuple[str, ...], series: dict[str, Series]) -> None:
    """One metric: training's values and running mean, held-out points."""
    for key, color in zip(keys, ("tab:green", "tab:red"), strict=False):
        if series[key]:
            held_out = key.startswith("eval_")
            (plot_held_out if held_out else plot_training)(ax, series[key], color,
                                                           f"{'held-out' if held_out else 'training'} {title}")
    ax.set(xlabel="optimizer step", ylabel=title)
    ax.grid(alpha=0.3)
    ax.legend()
