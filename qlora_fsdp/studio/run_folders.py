"""Every run under outputs/, whoever started it (this page, another studio, a terminal's torchrun): where it is,
what it trains, how far it got and its state (outputs/run_card.py: running while the process its run.json names
lives; finished, stopped (resumable) or failed from its files); and a run started elsewhere followed as the page
follows its own (FollowedRun: runs.Run's view of a folder)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlora_fsdp.outputs.run_card import RunState, read_run_card, run_state
from qlora_fsdp.outputs.run_dir import METRICS_FILE
from qlora_fsdp.studio.live import complete_records, progress
from qlora_fsdp.studio.processes import last_error_line
from qlora_fsdp.studio.runs import LOG_TAIL_LINES, terminal_tail

NO_LOG = "log: in the terminal that started it (a run writes its log to its terminal, not to its folder)"


@dataclass(frozen=True)
class RunFolder:
    path: Path
    objective: str | None  # from the run's start record (its resolved config); None before it started
    model: str | None
    step: int
    max_steps: int | None
    state: RunState  # outputs/run_card.py's one definition
    modified: float  # metrics.jsonl's last write

    def words(self) -> str:
        what = f"{self.objective} on {self.model}" if self.objective else "not started"
        steps = f"step {self.step}/{self.max_steps}" if self.max_steps is not None else "no steps"
        return f"{self.path} · {self.state} · {what} · {steps}"


def run_folder(path: Path) -> RunFolder:
    records = complete_records(path / METRICS_FILE)
    state = progress(records)
    config: dict[str, Any] = next((r.get("config", {}) for r in records if r.get("event") == "start"), {})
    metrics = path / METRICS_FILE
    return RunFolder(path, config.get("train", {}).get("objective"), config.get("model", {}).get("path"),
                     state.step, state.max_steps, run_state(path, records),
                     metrics.stat().st_mtime if metrics.is_file() else 0.0)


def runs_under(root: Path) -> list[RunFolder]:
    """Every run folder under `root` (one holding metrics.jsonl, at any depth; the studio's logs aside), newest
    first."""
    skipped = (root / "studio" / "logs").resolve()
    folders = [metrics.parent for metrics in root.rglob(METRICS_FILE)
               if not metrics.resolve().is_relative_to(skipped)]
    return sorted((run_folder(folder) for folder in folders), key=lambda f: f.modified, reverse=True)


class FollowedRun:
    """A run folder as the page's Run view reads runs.Run (output_dir, running, status, log_tail), whoever started
    it; its log is the studio's where a studio started it (`log_dir`), else it is in the starting terminal."""

    def __init__(self, path: Path, log_dir: Path | None = None) -> None:
        self.output_dir = path
        self.log_dir = log_dir

    @property
    def running(self) -> bool:
        card = read_run_card(self.output_dir)
        return card is not None and card.live()

    def folder(self) -> RunFolder:
        return run_folder(self.output_dir)

    def log_path(self) -> Path | None:
        """The newest studio log named after this folder and written to since the run started."""
        if self.log_dir is None or not self.log_dir.is_dir():
            return None
        started = next((r["time"] for r in complete_records(self.output_dir / METRICS_FILE)
                        if r.get("event") == "start"), None)
        logs = [log for log in self.log_dir.glob(f"{self.output_dir.name}-*.log")
                if started is None or log.stat().st_mtime >= started]
        return max(logs, key=lambda log: log.stat().st_mtime, default=None)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        log = self.log_path()
        return terminal_tail(log, lines) if log is not None else NO_LOG

    def status(self) -> str:
        folder, where = self.folder(), self.output_dir
        if folder.state == "running":
            return f"running (started outside this page) into {where}: stop it where it was started"
        if folder.state == "finished":
            return f"finished: the adapter is in {where / 'adapter'}"
        if folder.state == "stopped":
            resume = f"torchrun ... train.py --recipe ... train.output_dir={shlex.quote(str(where))} --resume"
            return f"stopped; the checkpoint in {where} is kept: `{resume}` continues it"
        if folder.state == "failed":
            log = self.log_path()
            said = last_error_line(log.read_text(errors="replace")) if log is not None else "see its terminal"
            return f"ended without a checkpoint or a summary: {said}"
        return f"not started: {where} holds no start record"
