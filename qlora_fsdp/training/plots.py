"""loss_curves.png from metrics.jsonl: training loss (and its running mean) and held-out loss against step."""

from __future__ import annotations

import json
import math
from pathlib import Path


def read_curves(metrics: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, training loss) of the steps that updated, and (step, eval loss)."""
    train, evals = [], []
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record and not record.get("skipped") and math.isfinite(record["loss"]):
            train.append((record["step"], record["loss"]))
        if "eval_loss" in record and math.isfinite(record["eval_loss"]):
            evals.append((record["step"], record["eval_loss"]))
    return train, evals


def running_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_loss_curves(metrics: Path, png: Path) -> Path | None:
    """Write the PNG; None when there is nothing to plot yet."""
    train, evals = read_curves(metrics)
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed on a cluster node
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if train:
        steps, losses = zip(*train, strict=True)
        ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="training loss")
        window = max(1, len(losses) // 20)
        ax.plot(steps, running_mean(list(losses), window), color="tab:blue", label=f"training, mean of {window}")
    if evals:
        steps, losses = zip(*evals, strict=True)
        ax.plot(steps, losses, "o-", color="tab:orange", label="held-out loss")
    ax.set(xlabel="optimizer step", ylabel="loss (per target token)", title=metrics.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return png
