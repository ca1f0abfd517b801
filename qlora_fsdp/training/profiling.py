"""`profile.memory` and `profile.trace`: what the first steps allocate and where their time goes.

The memory snapshot (CUDA only) opens at https://pytorch.org/memory_viz; the trace in Perfetto or
chrome://tracing. Both cover `profile.steps` steps and then switch themselves off, so a long run pays once.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from qlora_fsdp.config import ProfileConfig


class StepProfiler:
    def __init__(self, cfg: ProfileConfig, out_dir: Path, rank: int, device: torch.device) -> None:
        self.cfg, self.dir, self.rank, self.device = cfg, out_dir / "profile", rank, device
        self.recording_memory = False
        self.trace: profile | None = None
        self.steps_seen = 0
        self.written: list[Path] = []

    def notes(self) -> list[str]:
        """Lines for the run log about what was asked but cannot be done here."""
        if self.cfg.memory and self.device.type != "cuda":
            return ["profile.memory records CUDA allocations; this run is on the CPU, so there is no snapshot"]
        return []

    def start(self) -> None:
        if self.cfg.memory or self.cfg.trace:
            self.dir.mkdir(parents=True, exist_ok=True)
        if self.cfg.memory and self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            self.recording_memory = True
        if self.cfg.trace:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.trace = profile(activities=activities, record_shapes=True, profile_memory=True,
                                 schedule=schedule(wait=0, warmup=1, active=self.cfg.steps, repeat=1),
                                 on_trace_ready=self.save_trace)
            self.trace.start()

    def step_done(self) -> None:
        self.steps_seen += 1
        if self.trace is not None:
            self.trace.step()
            if self.steps_seen > self.cfg.steps:  # the warm-up step and `steps` recorded ones are done
                self.finish_trace()
        if self.recording_memory and self.steps_seen >= self.cfg.steps:
            self.save_memory()

    def stop(self) -> None:
        """At the end of training, for runs shorter than the profiled window."""
        if self.trace is not None:
            self.finish_trace()
        if self.recording_memory:
            self.save_memory()

    def finish_trace(self) -> None:
        trace, self.trace = self.trace, None
        assert trace is not None, "called only while a trace runs (step_done, stop)"
        trace.stop()

    def save_trace(self, prof: profile) -> None:
        path = self.dir / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(path))
        self.written.append(path)

    def save_memory(self) -> None:
        path = self.dir / f"memory_rank{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording_memory = False
        self.written.append(path)
