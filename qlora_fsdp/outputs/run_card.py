"""A run's card: `run.json` in its folder, written by rank 0 when training starts (after the folder is ready), so
the folder says who is training into it and how it was started: the process (its pid and start time, the host), the
command's recipe and overrides, the working directory, the resolved recipe. The studio lists and follows runs by it,
`--resume-from` without `--recipe` takes the command from it, and the hardware view follows a run it names; and a
run's state (running, finished, stopped, failed) is defined once, here, from the card and the folder's files."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

RUN_CARD = "run.json"
RunState = Literal["running", "finished", "stopped", "failed", "unknown"]


def process_start_time(pid: int) -> int | None:
    """The process's start, in clock ticks since boot (/proc's stat field 22): a pid reused later differs."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class RunCard:
    pid: int  # rank 0's process
    started_ticks: int | None  # its start time (process_start_time), which tells it from a later process of that pid
    host: str
    cwd: str
    recipe: str  # train.py's --recipe, as given
    overrides: list[str]  # its key=value overrides, as given
    output_dir: str  # resolved
    world_size: int
    started: float = field(default_factory=time.time)
    config: dict[str, Any] = field(default_factory=dict)  # the resolved recipe

    @classmethod
    def of_this_process(cls, recipe: str, overrides: list[str], output_dir: Path, world_size: int,
                        config: dict[str, Any]) -> RunCard:
        pid = os.getpid()
        return cls(pid, process_start_time(pid), socket.gethostname(), os.getcwd(), recipe, list(overrides),
                   str(output_dir.resolve()), world_size, config=config)

    def live(self) -> bool:
        """Its process is alive on this machine (and is that process, not a later one given its pid)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process of that pid: alive, and its start time tells
            pass
        started = process_start_time(self.pid)
        return self.started_ticks is None or started is None or started == self.started_ticks


def write_run_card(folder: Path, card: RunCard) -> None:
    """Atomically (a reader never sees half a card)."""
    temporary = folder / f".{RUN_CARD}.tmp"
    temporary.write_text(json.dumps(asdict(card), indent=1) + "\n")
    os.replace(temporary, folder / RUN_CARD)


def read_run_card(folder: Path) -> RunCard | None:
    """The folder's card; None where it has none (a run from before cards, or one not started) or it is unreadable."""
    try:
        return RunCard(**json.loads((folder / RUN_CARD).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def run_state(folder: Path, records: list[dict[str, Any]]) -> RunState:
    """The one definition of a run's state, from its card and its files (`records`: its metrics.jsonl's):
    running while the card's process lives; finished with a summary (not a signal's) after the last start and the
    adapter written; stopped (resumable) with a complete checkpoint; failed once it started; else unknown."""
    from qlora_fsdp.outputs.checkpoints import complete_checkpoints  # torch's: train.py's command line stays light

    card = read_run_card(folder)
    if card is not None and card.live():
        return "running"
    last_start = max((i for i, r in enumerate(records) if r.get("event") in ("start", "resume")), default=None)
    summaries = [r for r in records[(last_start or 0):] if r.get("event") == "summary"]
    ended_well = bool(summaries) and not summaries[-1].get("stopped_by_signal")
    if ended_well and (folder / "adapter" / "adapter_config.json").is_file():
        return "finished"
    if complete_checkpoints(folder):  # stopped by a signal, or ended by an error after a checkpoint
        return "stopped"
    return "failed" if last_start is not None else "unknown"
