"""The plan and the run as pictures (matplotlib figures the page shows): memory as stacked bars by component against
the cards' size, the step's time split, and the run's curves."""

from __future__ import annotations

import math
from typing import Any

import matplotlib

matplotlib.use("Agg")  # the page renders figures to images; no display
from matplotlib.figure import Figure  # noqa: E402

from qlora_fsdp.outputs.plots import metric_panels  # noqa: E402
from qlora_fsdp.studio.live import Series  # noqa: E402

SMALLEST_SHOWN_GIB = 0.005  # components below this are left out of the bars (their legend would be noise)


def short_name(name: str) -> str:
    """A plan row's name without its parenthesised detail, for a legend."""
    return name.split(" (")[0].split(": ")[0][:48]


def memory_bars(plan: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]], float | None]]:
    """(bar, its rows, its capacity in GiB) for each bar: the GPU in the update, while generating, host RAM."""
    capacity = plan["capacity_gib"] if math.isfinite(plan["capacity_gib"]) else None
    bars = [("GPU (update)" if plan["generating_rows"] else "GPU", plan["gpu_rows"], capacity)]
    if plan["generating_rows"]:
        bars.append(("GPU (generating)", plan["generating_rows"], capacity))
    bars.append(("host RAM", plan["host_rows"], plan["host_capacity_gib"]))
    return bars


def draw_bars(ax: Any, bars: list[tuple[str, list[dict[str, Any]], float | None]], colors: dict[str, Any]) -> None:
    """Stacked bars, one per (name, rows, capacity), a component's color the same on every bar."""
    palette = matplotlib.colormaps["tab20"]
    for index, (_, rows, capacity) in enumerate(bars):
        bottom = 0.0
        for row in rows:
            if row["gib"] < SMALLEST_SHOWN_GIB:
                continue
            name = short_name(row["name"])
            label = None if name in colors else name
            color = colors.setdefault(name, palette(len(colors) % 20))
            ax.barh(index, row["gib"], left=bottom, color=color, label=label, edgecolor="white", linewidth=0.5)
            bottom += row["gib"]
        if capacity:
            ax.plot([capacity, capacity], [index - 0.45, index + 0.45], color="crimson", linewidth=2)
        ax.annotate(f" {bottom:.2f}" + (f" of {capacity:g} GiB" if capacity else " GiB"), (bottom, index),
                    va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), [name for name, _, _ in bars])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.3 * max([*[c or 0 for _, _, c in bars], *[sum(r["gib"] for r in rows) for _, rows, _ in bars]]))


def memory_figure(plan: dict[str, Any]) -> Figure:
    """The GPU (in the update and, for GRPO, while generating) and host RAM, each on its own scale."""
    bars = memory_bars(plan)
    gpu, host = bars[:-1], bars[-1:]
    figure = Figure(figsize=(9, 1.2 + 0.7 * len(bars)), layout="constrained")
    gpu_ax, host_ax = figure.subplots(2, 1, height_ratios=[len(gpu), 1])
    colors: dict[str, Any] = {}
    draw_bars(gpu_ax, gpu, colors)
    draw_bars(host_ax, host, colors)
    host_ax.set_xlabel("GiB (red line: the card's size, the host's where the recipe gives it)", fontsize=8)
    figure.legend(fontsize=7, loc="outside right upper", frameon=False)
    gpu_ax.set_title("FITS" if plan["fits"] else "DOES NOT FIT", color="green" if plan["fits"] else "crimson",
                     fontsize=11, loc="left")
    return figure


def time_figure(plan: dict[str, Any]) -> Figure | None:
    """The step's seconds by kind of work, one stacked bar; None where the plan has no rates (CPU recipes)."""
    time = plan.get("time")
    if not time:
        return None
    figure = Figure(figsize=(9, 1.6), layout="constrained")
    ax = figure.subplots()
    left = 0.0
    palette = matplotlib.colormaps["Set2"]
    for index, (part, seconds) in enumerate((k, v) for k, v in time.items() if k != "total"):
        if seconds <= 0:
            continue
        ax.barh(0, seconds, left=left, color=palette(index), label=f"{part}: {seconds:.2f} s")
        left += seconds
    ax.set_yticks([])
    ax.set_xlabel(f"seconds an optimizer step: {time['total']:.2f} s in all")
    figure.legend(fontsize=7, loc="outside right upper", frameon=False)
    return figure


def curve_panels(series: dict[str, Series]) -> list[tuple[str, tuple[str, ...]]]:
    """Loss, then each of the objective's metrics (loss_curves.png's grouping), then tokens/s and memory."""
    fixed = {key for _, keys in CURVE_PANELS for key in keys}
    named = [key for key in series if key not in fixed]
    metrics = metric_panels(tuple(k for k in named if not k.startswith("eval_")),
                            tuple(k for k in named if k.startswith("eval_")))
    return [CURVE_PANELS[0], *metrics, *CURVE_PANELS[1:]]


def curves_figure(series: dict[str, Series]) -> Figure | None:
    """The run's curves, one small panel each (loss with eval loss, the objective's metrics, tokens/s, memory);
    None before any."""
    panels = [(title, keys) for title, keys in curve_panels(series) if any(series.get(key) for key in keys)]
    if not panels:
        return None
    figure = Figure(figsize=(9, 2.6 * math.ceil(len(panels) / 2)), layout="constrained")
    axes = figure.subplots(math.ceil(len(panels) / 2), 2, squeeze=False).ravel()
    for ax, (title, keys) in zip(axes, panels, strict=False):
        for key in keys:
            points = series.get(key)
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="o" if len(points) < 20 else None, markersize=3, label=key)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7, frameon=False)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    return figure


CURVE_PANELS = (("loss", ("loss", "eval_loss")), ("tokens/s", ("tokens_per_s", "generated_tokens_per_s")),
                ("memory (GiB)", ("peak_memory_gib",)))
