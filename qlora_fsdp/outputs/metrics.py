"""Progress bar, metrics JSONL and the end-of-run summary (rank 0 writes; every rank may call).

Named metrics.py rather than logging.py so it never shadows the standard library's logging module.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from qlora_fsdp.outputs.tracking import Tracker, numeric


def proc_status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM, RssAnon, ...), in bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # the file gives kB


def memory_peaks_gib(device: torch.device) -> dict[str, float]:
    """Peak memory since the last `reset_memory_peaks`, in GiB. On CUDA, allocated and reserved side by side:
    reserved minus allocated is what the caching allocator holds unused (fragmentation), and reserved is what
    runs out first. On CPU, the process's peak resident memory since it started."""
    if device.type == "cuda":
        return {"peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    # VmHWM, not ru_maxrss: a child started by exec or spawn inherits its parent's ru_maxrss
    return {"peak_memory_gib": proc_status_bytes("VmHWM") / 2**30}


def reset_memory_peaks(device: torch.device) -> None:
    """Start a new peak window (each step's record shows that step's peak); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


SUMMED = ("tokens", "target_tokens", "positions", "skipped")  # counts: the window's total
LATEST = ("step", "lr", "loss_scale")  # where the window ends
RATES = ("tokens_per_s", "mfu")  # over the window's time: its tokens over its seconds


class StepWindow:
    """The steps since the last metrics record (train.log_every): one record for them all, as a record of one long
    step would read. Counts are summed, memory peaks their largest, rates taken over the window's time, the learning
    rate and loss scale its last step's, evaluation its own; the rest (loss, gradient norm, rewards) averaged."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def take(self) -> dict[str, Any]:
        records, self.records = self.records, []
        if len(records) == 1:
            return records[0]
        seconds = [r["step_time_s"] for r in records]
        merged: dict[str, Any] = {}
        for key in dict.fromkeys(k for r in records for k in r):
            values = [r[key] for r in records if key in r]
            if key in SUMMED:
                merged[key] = sum(values)
            elif key in LATEST or key.startswith("eval_"):
                merged[key] = values[-1]
            elif key.startswith("peak_") or key.endswith("_gib"):
                merged[key] = max(values)
            elif key in RATES:
                merged[key] = sum(r[key] * r["step_time_s"] for r in records if key in r) / sum(seconds)
            else:
                merged[key] = sum(values) / len(values)
        return {**merged, "steps_in_record": len(records)}


class MetricsLogger:
    """metrics.jsonl, the progress bar, and any trackers (TensorBoard, W&B) fed with each step's values."""

    def __init__(self, output_dir: Path, total_steps: int, enabled: bool, trackers: Sequence[Tracker] = ()) -> None:
        self.enabled = enabled
        self.trackers = list(trackers)
        self.path = output_dir / "metrics.jsonl"
        self.bar = None
        if enabled:
            self.bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True, file=sys.stdout, mininterval=1.0)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
        if "step" in record and "event" not in record:
            for tracker in self.trackers:
                tracker.log(record["step"], numeric(record))

    def log_completions(self, step: int, record: dict[str, Any] | None) -> None:
        """A few of the step's generated completions with their rewards (GRPO): completions.jsonl beside the
        metrics."""
        if self.enabled and record is not None:
            with (self.path.parent / "completions.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, **record}) + "\n")

    def progress(self, step: int, values: dict[str, float]) -> None:
        if self.bar is None:
            return
        self.bar.n = step
        self.bar.set_postfix_str(format_progress(values), refresh=True)

    def write(self, line: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def format_progress(values: dict[str, float]) -> str:
    parts = []
    for key, value in values.items():
        if key == "lr":
            parts.append(f"lr={value:.2e}")
        elif key in ("tokens_per_s",):
            parts.append(f"tok/s={value:,.0f}")
        elif key == "mfu":
            parts.append(f"mfu={value:.1%}")
        elif key == "peak_memory_gib":
            parts.append(f"mem={value:.2f}G")
        else:
            parts.append(f"{key}={value:.4f}")
    return " ".join(parts)


def format_summary(summary: dict[str, Any]) -> str:
    width = max(len(k) for k in summary)
    lines = ["", "summary".center(width + 16, "-")]
    for key, value in summary.items():
        lines.append(f"{key.ljust(width)} : {format_summary_value(key, value)}")
    return "\n".join(lines)


def format_summary_value(key: str, value: Any) -> str:
    """Each figure as a reader wants it; the key's suffix says what it is (`_s` seconds, `_per_s` a rate, ...)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"  # counts: 5,204, never 5,204.0000
    if not math.isfinite(value):
        return str(value)  # nan: no held-out set was evaluated
    if key.endswith("_per_s"):
        return format_rate(value)
    if key.endswith("_s"):
        return format_duration(value)
    if key == "mfu":
        return f"{value:.2%}"
    if key.endswith(("_gib", "_gib_max_rank")):
        return f"{value:,.2f} GiB"
    if "ppl" in key:
        return f"{value:,.2f}"
    return f"{value:,.4f}"  # losses


def format_rate(value: float) -> str:
    """At least three significant digits, and no decimals once in the hundreds: 0.0123, 3.21, 45.6, 1,234."""
    decimals = max(0, 2 - math.floor(math.log10(abs(value)))) if value else 0
    return f"{value:,.{decimals}f}"


def format_duration(seconds: float) -> str:
    """41.3 s, 3 min 12 s, 1 h 02 min: tenths of a second under a minute, whole seconds under an hour."""
    if round(seconds, 1) < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min"
