"""SIGTERM/SIGINT: finish the optimizer step, save, exit cleanly; a second signal exits at once.

The flag is only read between steps, and all ranks agree on it through one all-reduce, so no rank
starts saving while another is still inside the step's collectives.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeAlias

import torch

from qlora_fsdp.distributed import all_reduce_max
from qlora_fsdp.distributed.rank_errors import end_if_peer_failed, peer_failed

HANDLED = (signal.SIGTERM, signal.SIGINT)
# Ctrl-C under torchrun reaches a worker twice within milliseconds (from the terminal, then forwarded by the
# agent); a repeat inside this window is the same request, not the user insisting.
SAME_REQUEST_S = 1.0
# what signal.signal installs and returns: a function, SIG_DFL / SIG_IGN, or None (not installed from Python)
Handler: TypeAlias = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class GracefulStop:
    def __init__(self) -> None:
        self.received: int | None = None
        self.received_at = 0.0
        self.previous: dict[signal.Signals, Handler] = {}

    def install(self) -> GracefulStop:
        for sig in HANDLED:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and peer_failed():  # torchrun stopping us because a peer hit a user error
            end_if_peer_failed()
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()
            print(f"\n{signal.Signals(signum).name}: finishing this step, saving a checkpoint, then exiting "
                  "(send it again to exit at once)", flush=True)
            return
        if time.monotonic() - self.received_at < SAME_REQUEST_S:
            return
        signal.signal(signum, signal.SIG_DFL)  # the user insists: die by the signal, unsaved
        os.kill(os.getpid(), signum)

    def requested(self, device: torch.device) -> bool:
        """Whether any rank got a signal; a collective, so every rank calls it at the same point."""
        return all_reduce_max(1.0 if self.received is not None else 0.0, device) > 0
