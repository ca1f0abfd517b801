"""The Hardware tab: the GPUs and host RAM (a table), which GPUs a launch uses, and the run's memory and utilisation
as the peak of each step (hardware.py samples; this draws it on the page's timer, ticks.py)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import gradio as gr
from matplotlib.figure import Figure

from qlora_fsdp.readouts.machine_gpus import HardwareMonitor, Sample, hardware_markdown
from qlora_fsdp.studio.ticks import TickPart


def gpu_choices(now: Sample) -> list[tuple[str, int]]:
    return [(f"{gpu.index}: {gpu.name}", gpu.index) for gpu in now.gpus]


def peaks_figure(peaks: dict[int, Sample]) -> Figure | None:
    """Each step's peak: GPU memory used (per GPU) and host RAM used, in GiB; GPU utilisation in percent."""
    if not peaks:
        return None
    steps = sorted(peaks)
    figure = Figure(figsize=(9, 3.2), layout="constrained")
    memory, busy = figure.subplots(1, 2)
    for index in sorted({gpu.index for sample in peaks.values() for gpu in sample.gpus}):
        used = [(step, gpu) for step in steps for gpu in peaks[step].gpus if gpu.index == index]
        memory.plot([s for s, _ in used], [g.used_gib for _, g in used], marker=".", label=f"GPU {index}")
        busy.plot([s for s, _ in used], [g.utilisation for _, g in used], marker=".", label=f"GPU {index}")
    memory.plot(steps, [peaks[step].host_used_gib for step in steps], linestyle="--", color="gray", label="host RAM")
    memory.set(xlabel="step (0: loading)", ylabel="GiB, peak of the step", title="memory used")
    busy.set(xlabel="step (0: loading)", ylabel="%", ylim=(0, 105), title="GPU utilisation")
    memory.legend(fontsize="small")
    if busy.lines:
        busy.legend(fontsize="small")
    return figure


def hardware_tab(monitor: HardwareMonitor | None = None) -> SimpleNamespace:
    """The tab's components (elem_ids hw-*) and the monitor behind them (one for the page's server)."""
    monitor = monitor if monitor is not None else HardwareMonitor()
    now, _ = monitor.take()
    table = gr.Markdown(hardware_markdown(now, monitor.error), elem_id="hw-table")
    choices = gpu_choices(now)
    gpus = gr.CheckboxGroup(choices=choices, value=[index for _, index in choices], label="GPUs to use",
                            info="a launch sets CUDA_VISIBLE_DEVICES to these (all of them: as a terminal's torchrun)",
                            elem_id="hw-gpus", visible=bool(choices))
    peaks = gr.Plot(elem_id="hw-peaks", show_label=False)
    note = gr.Markdown("The run's memory and utilisation, the peak of each step (sampled every "
                       f"{monitor.interval_s:g} s while a run trains).", elem_id="hw-note")
    return SimpleNamespace(monitor=monitor, table=table, gpus=gpus, peaks=peaks, note=note)


def tick_outputs(monitor: HardwareMonitor, run: Any, drawn: int) -> tuple[str, Any, int]:
    """The table (the highest readings since the last tick) and, where the sampler took more samples since this
    page drew it (`drawn`: its count then), the curve; the sampler follows `run` while it runs."""
    if run is not None and run.running:
        monitor.follow(run)  # where the launch did not start it, or a run started outside the page
    now, peaks = monitor.take()
    if monitor.samples == drawn:  # nothing sampled since: the curve stays as drawn
        return hardware_markdown(now, monitor.error), gr.skip(), drawn
    return hardware_markdown(now, monitor.error), peaks_figure(peaks), monitor.samples


def hardware_tick(studio: Any, hw: SimpleNamespace, shown: Callable[[], Any] | None = None) -> TickPart:
    """The tab's share of the page's tick, for the run the page shows (`shown()`; the studio's own run by default)."""
    seen = gr.State(-1)  # the sample count this page last drew the curve at

    def refresh(drawn: int) -> tuple[str, Any, int]:
        return tick_outputs(hw.monitor, shown() if shown is not None else studio.runs.current, drawn)

    return TickPart(refresh, [seen], [hw.table, hw.peaks, seen])
