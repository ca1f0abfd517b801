"""Every run under outputs/, whoever started it (this page, another studio, a terminal's torchrun): where it is,
what it trains, how far it got and whether it is running, finished, stopped (resumable) or failed; and a run
started elsewhere followed as the page follows its own (FollowedRun: runs.Run's view of a folder)."""

from __future__ import annotations

import functools
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlora_fsdp.config import last_override, load_config
from qlora_fsdp.outputs.checkpoints import complete_checkpoints
from qlora_fsdp.outputs.run_dir import METRICS_FILE
from qlora_fsdp.studio.live import Progress, complete_records, progress
from qlora_fsdp.studio.processes import last_error_line
from qlora_fsdp.studio.runs import LOG_TAIL_LINES, terminal_tail

TRAIN_SCRIPTS = ("train.py", "qlora-train")  # how a training process is started: a script's name, or the module
TRAIN_MODULE = "qlora_fsdp.commands.train"
DEFAULT_RECIPE = "tiny_cpu"  # train.py's --recipe default
NO_LOG = "log: in the terminal that started it (a run writes its log to its terminal, not to its folder)"


@dataclass(frozen=True)
class RunFolder:
    path: Path
    objective: str | None  # from the run's start record (its resolved config); None before it started
    model: str | None
    step: int
    max_steps: int | None
    state: str  # running, finished, stopped (a complete checkpoint: resumable), failed, unknown (no start record)
    modified: float  # metrics.jsonl's last write

    def words(self) -> str:
        what = f"{self.objective} on {self.model}" if self.objective else "not started"
        steps = f"step {self.step}/{self.max_steps}" if self.max_steps is not None else "no steps"
        return f"{self.path} · {self.state} · {what} · {steps}"


def train_arguments_of(argv: list[str]) -> list[str] | None:
    """train.py's own arguments in a process's command line (torchrun's and its ranks' alike), None if it is none."""
    for i, word in enumerate(argv):
        if Path(word).name in TRAIN_SCRIPTS or word == TRAIN_MODULE:
            return argv[i + 1:]
    return None


@functools.lru_cache(maxsize=64)
def output_dir_of(cwd: str, arguments: tuple[str, ...]) -> Path | None:
    """The folder a training command writes to, resolved as it was in its own working directory (cached: the
    command of a live process does not change)."""
    recipe, overrides, words = DEFAULT_RECIPE, [], list(arguments)
    while words:
        word = words.pop(0)
        if word == "--recipe" and words:
            recipe = words.pop(0)
        elif word.startswith("--recipe="):
            recipe = word.partition("=")[2]
        elif "=" in word and not word.startswith("-"):
            overrides.append(word)
    named = last_override(overrides, "train.output_dir")
    if named is not None:
        return (Path(cwd) / named).resolve()
    as_file = Path(cwd) / recipe
    try:
        cfg = load_config(str(as_file) if as_file.is_file() else recipe, overrides)
    except Exception:  # a command that would not start: it writes nowhere
        return None
    return (Path(cwd) / cfg.train.output_dir).resolve()


def training_folders(proc: Path = Path("/proc")) -> set[Path]:
    """The output folders of the training processes alive on this machine, from their command lines."""
    found = set()
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace").split("\0")[:-1]
            arguments = train_arguments_of(argv)
            if arguments is None or "--plan" in arguments or "--print-config" in arguments:
                continue
            cwd = os.readlink(cmdline.parent / "cwd")
        except OSError:  # ended meanwhile, or another user's
            continue
        folder = output_dir_of(cwd, tuple(arguments))
        if folder is not None:
            found.add(folder)
    return found


def run_folder(path: Path, live: set[Path]) -> RunFolder:
    records = complete_records(path / METRICS_FILE)
    state = progress(records)
    config: dict[str, Any] = next((r.get("config", {}) for r in records if r.get("event") == "start"), {})
    metrics = path / METRICS_FILE
    return RunFolder(path, config.get("train", {}).get("objective"), config.get("model", {}).get("path"),
                     state.step, state.max_steps, folder_state(path, state, live),
                     metrics.stat().st_mtime if metrics.is_file() else 0.0)


def folder_state(path: Path, state: Progress, live: set[Path]) -> str:
    if path.resolve() in live:
        return "running"
    if state.finished and not state.stopped_by_signal and (path / "adapter" / "adapter_config.json").is_file():
        return "finished"
    if complete_checkpoints(path):  # stopped by a signal, or ended by an error after a checkpoint: resumable
        return "stopped"
    return "failed" if state.max_steps is not None else "unknown"


def runs_under(root: Path) -> list[RunFolder]:
    """Every run folder under `root` (one holding metrics.jsonl, at any depth; the studio's logs aside), newest
    first."""
    skipped = (root / "studio" / "logs").resolve()
    live = training_folders()
    folders = [metrics.parent for metrics in root.rglob(METRICS_FILE)
               if not metrics.resolve().is_relative_to(skipped)]
    return sorted((run_folder(folder, live) for folder in folders), key=lambda f: f.modified, reverse=True)


class FollowedRun:
    """A run folder as the page's Run view reads runs.Run (output_dir, running, status, log_tail), whoever started
    it; its log is the studio's where a studio started it (`log_dir`), else it is in the starting terminal."""

    def __init__(self, path: Path, log_dir: Path | None = None) -> None:
        self.output_dir = path
        self.log_dir = log_dir

    @property
    def running(self) -> bool:
        return self.output_dir.resolve() in training_folders()

    def folder(self) -> RunFolder:
        return run_folder(self.output_dir, training_folders())

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
