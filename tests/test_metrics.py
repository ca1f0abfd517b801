"""Memory figures as a CUDA run reports them, with the CUDA calls faked: allocated beside reserved."""

from __future__ import annotations

import math

import torch

from qlora_fsdp.outputs.metrics import (
    StepWindow,
    format_duration,
    format_progress,
    format_rate,
    format_summary,
    memory_peaks_gib,
    reset_memory_peaks,
)
from qlora_fsdp.training.records import RunSummary

GIB = 2**30


def test_cuda_memory_peaks_report_reserved_beside_allocated(monkeypatch):
    peaks = {"allocated": 12 * GIB, "reserved": 15 * GIB}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: peaks["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: peaks["reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: peaks.update(allocated=0, reserved=0))
    cuda = torch.device("cuda", 0)
    assert memory_peaks_gib(cuda) == {"peak_memory_gib": 12.0, "peak_reserved_gib": 15.0}
    reset_memory_peaks(cuda)  # each step's record is that step's peak
    assert memory_peaks_gib(cuda) == {"peak_memory_gib": 0.0, "peak_reserved_gib": 0.0}
    assert format_progress({"loss": 1.5, "peak_memory_gib": 12.0}) == "loss=1.5000 mem=12.00G"


def step(n: int, loss: float, tokens: float, seconds: float, **more: float) -> dict:
    return {"step": n, "loss": loss, "lr": 0.1 * n, "grad_norm": 2.0 * n, "tokens": tokens, "skipped": 0,
            "tokens_per_s": tokens / seconds, "mfu": tokens / seconds / 1000, "step_time_s": seconds,
            "peak_memory_gib": 1.0 + n % 2, **more}


def test_a_window_of_steps_reads_as_one_long_step():
    window = StepWindow()
    window.add(step(1, 4.0, 100, 1.0))
    assert window.take() == step(1, 4.0, 100, 1.0)  # a window of one step is that step, as before log_every
    for record in (step(2, 3.0, 100, 1.0), step(3, 2.0, 300, 3.0), step(4, 1.0, 200, 4.0, eval_loss=0.5)):
        window.add(record)
    merged = window.take()
    assert merged["step"] == 4 and merged["lr"] == 0.4 and merged["eval_loss"] == 0.5  # where it ends
    assert merged["loss"] == 2.0 and merged["grad_norm"] == 6.0  # averaged
    assert merged["tokens"] == 600 and merged["skipped"] == 0  # summed
    assert merged["tokens_per_s"] == 600 / 8.0 and math.isclose(merged["mfu"], 600 / 8.0 / 1000)  # over its time
    assert merged["peak_memory_gib"] == 2.0 and merged["steps_in_record"] == 3
    assert window.records == []


# ---- the run summary ----

def test_summary_prints_counts_as_integers_and_times_rounded():
    summary = RunSummary(train_runtime_s=192.4, steps=150, skipped_steps=0, samples=5204, tokens=1_234_567,
                         mfu=0.0123, held_out={"eval_loss_start": 2.345678, "eval_loss_end": 1.234561,
                                               "eval_ppl_start": 10.44, "eval_ppl_end": 3.4367},
                         memory_peaks_gib={"peak_memory_gib": 1.5}, adapter="outputs/demo/adapter")
    lines = format_summary(summary.as_dict()).split("\n")
    assert lines[:2] == ["", "summary".center(len("peak_memory_gib_max_rank") + 16, "-")]
    shown = dict(line.split(" : ") for line in lines[2:])
    assert {key.strip(): value for key, value in shown.items()} == {
        "train_runtime_s": "3 min 12 s", "steps": "150", "skipped_steps": "0", "samples": "5,204",
        "samples_per_s": "27.0", "tokens": "1,234,567", "tokens_per_s": "6,417", "mfu": "1.23%",
        "eval_loss_start": "2.3457", "eval_loss_end": "1.2346", "eval_ppl_start": "10.44", "eval_ppl_end": "3.44",
        "peak_memory_gib_max_rank": "1.50 GiB", "adapter": "outputs/demo/adapter"}


def test_durations_and_rates():
    assert [format_duration(s) for s in (0.04, 41.27, 59.96, 192.4, 3599.6, 3720, 90_000)] == [
        "0.0 s", "41.3 s", "1 min 00 s", "3 min 12 s", "1 h 00 min", "1 h 02 min", "25 h 00 min"]
    assert [format_rate(r) for r in (0.0, 0.012345, 3.2149, 45.61, 1234.4)] == ["0", "0.0123", "3.21", "45.6",
                                                                                "1,234"]
    assert format_summary({"eval_loss_end": math.nan, "stopped_by_signal": True}).split("\n")[2:] == [
        "eval_loss_end     : nan", "stopped_by_signal : True"]
