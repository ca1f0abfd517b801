"""The page's one timer. A tick refreshes the Run and Hardware tabs in a single event, since each event costs the
browser's Gradio frontend about 0.15 CPU-s whatever it updates: an idle page on the Run tab with two events every
2 s kept headless Chromium at 0.4 CPU-s/s, against 0.13 with no timer. So the timer ticks every TICK_S while the run
the page shows trains, and every IDLE_TICK_S when nothing on those tabs changes faster; a launch or a followed run
speeds it up at once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gradio as gr

TICK_S = 2.0  # while the shown run trains: its progress, curves and the GPUs' peaks
IDLE_TICK_S = 10.0  # otherwise: host RAM, a run started elsewhere, an adapter a finished run wrote


@dataclass
class TickPart:
    """One tab's share of a tick: `refresh(*values of inputs)` returns one value per output."""
    refresh: Callable[..., tuple[Any, ...]]
    inputs: list[Any]
    outputs: list[Any]


def interval_for(live: bool) -> float:
    return TICK_S if live else IDLE_TICK_S


def tick_function(parts: list[TickPart], live: Callable[[], bool]) -> Callable[..., tuple[Any, ...]]:
    """The tick's handler: each part's outputs, then the timer's new interval (skipped where it stays) and the
    interval this page's timer now has (the last input)."""
    def tick(*values: Any) -> tuple[Any, ...]:
        results: list[Any] = []
        at = 0
        for part in parts:
            results.extend(part.refresh(*values[at:at + len(part.inputs)]))
            at += len(part.inputs)
        wanted = interval_for(live())
        return (*results, gr.skip() if wanted == values[-1] else wanted, wanted)
    return tick


def wire_ticks(timer: gr.Timer, interval: gr.State, parts: list[TickPart], live: Callable[[], bool]) -> None:
    """`interval`: the page's State holding the timer's interval (a launch sets both, see `fast`)."""
    inputs = [component for part in parts for component in part.inputs]
    outputs = [component for part in parts for component in part.outputs]
    timer.tick(tick_function(parts, live), [*inputs, interval], [*outputs, timer, interval],
               show_progress="hidden")


def fast() -> tuple[float, float]:
    """The timer's and its State's values once a run starts or is followed: the live pace at once."""
    return TICK_S, TICK_S
