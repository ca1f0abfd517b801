"""The page's run: `torchrun` with the draft's recipe on this machine's GPUs (or CPU ranks), its log, its stop
(SIGTERM to each rank, as a cluster scheduler preempts: the step ends and a checkpoint is kept) and its
resume. One run at a time; a launch into a used output folder is refused before anything starts, in the command
line's words."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from qlora_fsdp.config import REPO_ROOT, Config
from qlora_fsdp.errors import UserError
from qlora_fsdp.outputs.checkpoints import complete_checkpoints
from qlora_fsdp.outputs.plots import complete_records
from qlora_fsdp.outputs.run_card import run_state
from qlora_fsdp.outputs.run_dir import METRICS_FILE, check_run_dir
from qlora_fsdp.readouts.machine_gpus import cuda_visible_devices
from qlora_fsdp.studio.draft import Draft, resolve, torchrun_command, train_arguments
from qlora_fsdp.studio.environment import child_environment
from qlora_fsdp.studio.preflight import check_before_launch
from qlora_fsdp.studio.processes import child_processes, last_error_line

LOG_TAIL_LINES = 40


@dataclass
class Run:
    draft: Draft
    ranks: int
    output_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    resumed: bool
    stop_requested: bool = False
    visible_gpus: list[int] | None = None  # CUDA_VISIBLE_DEVICES; None: every GPU, as a terminal's torchrun

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return terminal_tail(self.log_path, lines)

    def status(self) -> str:
        """One line: running, then the folder's state (outputs/run_card.py's run_state): finished, stopped
        (resumable), or failed with the run's own error line."""
        code = self.process.poll()
        where = f"{self.output_dir}"
        if code is None:
            return f"running ({self.ranks} ranks, pid {self.process.pid}) into {where}" + (
                ": stopping, the checkpoint is being written" if self.stop_requested else "")
        state = run_state(self.output_dir, complete_records(self.output_dir / METRICS_FILE))
        if code == 0 and state == "finished":
            return f"finished: the adapter is in {self.output_dir / 'adapter'}"
        resumable = "; the checkpoint in {where} is kept: Resume continues it" if state == "stopped" else ""
        if code == 0 and state == "stopped":
            return f"stopped{resumable.format(where=where)}"
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        return f"failed (exit {code}): {last_error_line(text)}{resumable.format(where=where)}"


def terminal_tail(log_path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """A log's last lines as a terminal shows them: a progress bar's redraws (carriage returns) leave their last
    state only."""
    if not log_path.is_file():
        return ""
    text = log_path.read_bytes().decode(errors="replace").rstrip("\n")  # read_text would turn \r into \n
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n")[-lines:])


def refuse_launch(cfg: Config, resume: bool) -> None:
    """What the run itself would refuse at its start, said before anything is started."""
    out = Path(cfg.train.output_dir)
    if resume and not complete_checkpoints(out):
        raise UserError(f"nothing to resume in {out}: it holds no complete checkpoint; launch a new run instead")
    check_run_dir(out, cfg.train)


class Runs:
    """The studio's one run at a time; logs go to `log_dir` (the output folder must stay empty until the run starts
    in it)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.current: Run | None = None

    def launch(self, draft: Draft, ranks: int, resume: bool = False, visible_gpus: list[int] | None = None) -> Run:
        if self.current is not None and self.current.running:
            raise UserError(f"a run is going into {self.current.output_dir}: stop it before launching another")
        resolved = resolve(draft)
        if resolved.config is None:
            raise UserError(resolved.error.removeprefix("error: "))
        cfg = resolved.config
        check_before_launch(cfg, ranks, None if visible_gpus is None else len(set(visible_gpus)),
                            chosen=visible_gpus is not None)
        refuse_launch(cfg if not resume else load_resumed(draft), resume)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{Path(cfg.train.output_dir).name}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                   str(REPO_ROOT / "train.py"), *train_arguments(draft, resume)]
        with log_path.open("wb") as log:
            gpus = cuda_visible_devices(visible_gpus) if visible_gpus is not None else {}
            shown = "".join(f"{key}={value} " for key, value in gpus.items())
            log.write(f"$ {shown}{torchrun_command(draft, ranks, resume)}\n".encode())  # what a terminal would run
            log.flush()
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       env=child_environment(PYTHONUNBUFFERED="1", **gpus))
        self.current = Run(draft, ranks, Path(cfg.train.output_dir), log_path, process, resume,
                           visible_gpus=visible_gpus)
        return self.current

    def stop(self) -> Run:
        run = self.current
        if run is None or not run.running:
            raise UserError("no run is going")
        if run.stop_requested:  # a rank's second signal ends it at once, without the checkpoint being written
            raise UserError("the run is stopping already: its checkpoint is being written")
        run.stop_requested = True
        ranks = child_processes(run.process.pid)
        for pid in ranks or [run.process.pid]:  # not torchrun itself: it would end with an error of its own
            with contextlib.suppress(ProcessLookupError):  # a rank that ended meanwhile
                os.kill(pid, signal.SIGTERM)  # each rank ends its step, saves a checkpoint and exits 0
        return run

    def close(self, wait_s: float = 60.0) -> None:
        """At the studio's exit: a run still going is stopped as Stop does (its checkpoint kept)."""
        if self.current is not None and self.current.running:
            if not self.current.stop_requested:
                self.stop()
            try:
                self.current.process.wait(wait_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.current.process.pid, signal.SIGKILL)


def load_resumed(draft: Draft) -> Config:
    """The config as `--resume` makes it (train.resume=auto)."""
    resolved = resolve(draft.with_overrides(["train.resume=auto"]))
    assert resolved.config is not None, resolved.error
    return resolved.config
