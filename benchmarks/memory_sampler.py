"""Host memory of this process for the benchmarks: the exact peak RSS (VmHWM, resettable) and a sampled peak
of anonymous memory (what a load allocates, without the mapped checkpoint pages)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from qlora_fsdp.outputs.metrics import proc_status_bytes


def peak_rss_gib() -> float:
    return proc_status_bytes("VmHWM") / 2**30


def reset_peak_rss() -> None:
    """Start the peak (VmHWM) afresh. ru_maxrss cannot be used: a spawned child inherits its parent's peak,
    and the parent held the generated checkpoint (that error put 1.76 GiB on both of our ranks)."""
    Path("/proc/self/clear_refs").write_text("5")


class AnonPeak:
    """Peak of anonymous memory, sampled every millisecond by a thread. The peaks of a load are plateaus
    (a full tensor held while it is quantized, for tens of milliseconds), far longer than the interval."""

    def __init__(self) -> None:
        self.peak, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, proc_status_bytes("RssAnon"))
            time.sleep(0.001)

    def __enter__(self) -> AnonPeak:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, proc_status_bytes("RssAnon"))
