"""Progress bar, metrics JSONL and the end-of-run summary (rank 0 writes; every rank may call).

Named metrics.py rather than logging.py so it never shadows the standard library's logging module.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from qlora_fsdp.training.tracking import Tracker, numeric


def proc_status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM, RssAnon, ...), in bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # the file gives kB


def memory_peaks_gb(device: torch.device) -> dict[str, float]:
    """Peak memory since the last `reset_memory_peaks`, in GiB. On CUDA, allocated and reserved side by side:
    reserved minus allocated is what the caching allocator holds unused (fragmentation), and reserved is what
    runs out first. On CPU, the process's peak resident memory since it started."""
    if device.type == "cuda":
        return {"peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30,
                "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}
    # VmHWM, not ru_maxrss: a child started by exec or spawn inherits its parent's ru_maxrss
    return {"peak_memory_gb": proc_status_bytes("VmHWM") / 2**30}


def reset_memory_peaks(device: torch.device) -> None:
    """Start a new peak window (each step's record shows that step's peak); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


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
        elif key == "peak_memory_gb":
            parts.append(f"mem={value:.2f}G")
        else:
            parts.append(f"{key}={value:.4f}")
    return " ".join(parts)


def format_summary(summary: dict[str, Any]) -> str:
    width = max(len(k) for k in summary)
    lines = ["", "summary".center(width + 16, "-")]
    for key, value in summary.items():
        shown = f"{value:,.4f}" if isinstance(value, float) else str(value)
        lines.append(f"{key.ljust(width)} : {shown}")
    return "\n".join(lines)
