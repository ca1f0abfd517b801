"""A user error in a multi-rank run ends every rank with one line and exit code 2, and no tracebacks.

The rank that raises it publishes the line in the rendezvous store, writes it where torchrun reads a worker's
error (so torchrun's closing summary names it, with the raising rank as the root cause), prints it once for all
ranks, gives peers waiting in a barrier (which polls the store) a second to end first, and exits: only its exit
closes gloo's connections (destroying or aborting the group leaves them open). A peer whose collective then fails
("Connection closed by peer") finds the line in the store and ends the same way, silently; on CPU ranks a SIGTERM
from torchrun's agent, racing that, ends it the same way too. On CUDA a peer blocked in an NCCL kernel cannot run
Python: torchrun's SIGTERM kills it at once (the summary lists it as signalled), as before.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

ERROR_KEY = "qlora_fsdp/user_error"
RAISED_AT_KEY = "qlora_fsdp/user_error_raised_at"  # seconds since the epoch, as torchrun's error files keep time
PRINTED_KEY = "qlora_fsdp/user_error_printed"  # the first rank to add 1 prints the line
ENDED_KEY = "qlora_fsdp/user_error_ended"  # ranks that have ended because of it
PEERS_WAIT_S = 1.0  # a raising rank waits this long for peers waiting in a barrier to end first
PUBLISH_WAIT_S = 2.0  # how long a failed peer looks for a published line before treating its error as its own

_store: dist.Store | None = None  # shared_store's


def elastic_attempt_store() -> dist.Store | None:
    """Under torchrun, the agent's store with keys prefixed by the restart attempt.

    The agent keeps one store across `--max-restarts` attempts and workers use it unprefixed (torch 2.13), so a
    restarted rank could read a dead attempt's gloo address and hang in connect (seen in the elastic test).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                           is_master=False, timeout=timedelta(minutes=30))
    return dist.PrefixStore(f"qlora_fsdp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def shared_store() -> dist.Store | None:
    """The store every rank of this attempt reaches, even after a rank has exited: torchrun's agent store, else
    the default process group's; None in a plain process (nothing to share)."""
    global _store
    if _store is None:
        try:
            _store = elastic_attempt_store()
            if _store is None and dist.is_initialized():
                _store = dist.distributed_c10d._get_default_store()
        except Exception:  # no store to reach: callers report locally
            return None
    return _store


def forget_store() -> None:
    """The process group is gone: a later one in this process has a store of its own."""
    global _store
    _store = None


def end_with_user_error(line: str) -> NoReturn:
    """This rank raised a user error: publish it, print it once over all ranks, exit 2 now."""
    hold_sigterm()  # torchrun may stop us while we write; finish first
    store = shared_store()
    first, raised_at = True, int(time.time())
    try:
        if store is not None:
            store.set(RAISED_AT_KEY, str(raised_at))  # before the line: a peer that sees the line sees the time
            store.set(ERROR_KEY, line)
            store.add(ENDED_KEY, 1)
            first = store.add(PRINTED_KEY, 1) == 1
    except Exception:  # the store went away with the rank hosting it: print for ourselves
        store, first = None, True
    if first:  # another rank's progress bar may be mid-line on the same terminal
        print(("\n" if os.environ.get("RANK", "0") != "0" else "") + line, file=sys.stderr, flush=True)
    write_torchrun_error_file(line, raised_at)
    if store is not None:  # peers polling in a barrier end before torchrun's agent sees us gone and SIGTERMs them
        wait_until(lambda: store.add(ENDED_KEY, 0) >= world_size(), PEERS_WAIT_S)
    exit_now(2)


def end_if_peer_failed() -> None:
    """After an unexpected error (typically a failed collective): if another rank published a user error, this
    rank ends as it did, with exit code 2 and nothing printed; otherwise it returns and the error is this rank's."""
    hold_sigterm()
    store = shared_store()
    if store is not None and wait_until(lambda: store.check([ERROR_KEY]), PUBLISH_WAIT_S):
        # a second after the raising rank's: torchrun's root cause is the earliest, and ours follows from it
        raised_at = int(store.get(RAISED_AT_KEY).decode())
        write_torchrun_error_file(store.get(ERROR_KEY).decode(), max(int(time.time()), raised_at + 1))
        store.add(ENDED_KEY, 1)
        exit_now(2)
    release_sigterm()


def peer_failed() -> bool:
    """Whether a rank has published a user error (no waiting): for a signal handler deciding what SIGTERM means."""
    store = shared_store() if world_size() > 1 else None
    try:
        return store is not None and store.check([ERROR_KEY])
    except Exception:  # the store is gone: nothing published that we can read
        return False


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def write_torchrun_error_file(line: str, timestamp: int) -> None:
    """torchrun shows a worker's error file as that worker's failure, and the earliest one as the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not os.path.exists(path):  # the shape torchrun's own @record writes, the line for a traceback
        record = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(timestamp)}}
        with open(path, "w") as file:
            json.dump({"message": record}, file)


def install_sigterm_handler() -> None:
    """For the whole multi-rank run: torchrun's agent SIGTERMs the ranks left once one has exited, and a rank
    that is just then leaving a failed collective must still end as its peer's user error says (exit 2, quiet).
    Any other SIGTERM kills as before. Training's graceful stop installs its own handler over this one and checks
    the same (training/signals.py), then puts this one back. Not on CUDA: there a rank blocked in an NCCL kernel
    would only run a Python handler after torchrun's SIGKILL grace (30 s), where SIGTERM kills it at once."""
    if not torch.cuda.is_available():
        signal.signal(signal.SIGTERM, on_sigterm)


def on_sigterm(signum: int, frame: object) -> None:
    if peer_failed():
        end_if_peer_failed()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not ours to handle: die by it, as without a handler
    os.kill(os.getpid(), signal.SIGTERM)


def hold_sigterm() -> None:
    """A SIGTERM from torchrun's agent waits (pending) until we have exited or let it through."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def release_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def wait_until(condition: Callable[[], object], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if condition():
                return True
        except Exception:  # the store went away with the rank hosting it
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def exit_now(code: int) -> NoReturn:
    """Exit without interpreter teardown: destructors of a process group whose peers are gone can hang or print."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
