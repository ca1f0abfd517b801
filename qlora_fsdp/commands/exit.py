"""How every command ends: a UserError becomes one `error: ...` line on stderr and exit code 2.

Kept free of heavy imports so a bad recipe is reported before torch or bitsandbytes load.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

from qlora_fsdp.errors import UserError


def run_command(body: Callable[[], int]) -> int:
    """A command-line entry point's body; a UserError becomes one `error: ...` line on stderr and exit code 2.

    In a multi-rank run the line is printed once, every rank exits 2 without a traceback, and a rank whose
    collective failed because a peer raised one ends the same way (qlora_fsdp.distributed.rank_errors)."""
    if in_multi_rank_run():
        from qlora_fsdp.distributed.rank_errors import install_sigterm_handler

        install_sigterm_handler()
    try:
        return body()
    except UserError as err:
        line = f"error: {err}"
        finish_progress_bars()
        if in_multi_rank_run():
            from qlora_fsdp.distributed.rank_errors import end_with_user_error

            end_with_user_error(line)
        print(line, file=sys.stderr)
        close_process_group()
        return 2
    except Exception:
        if in_multi_rank_run():
            from qlora_fsdp.distributed.rank_errors import end_if_peer_failed

            end_if_peer_failed()  # returns when no peer published a user error: then the error is ours
        raise


def leave_process(main: Callable[[], int]) -> NoReturn:
    """A console entry point: run the command, then exit without interpreter teardown.

    Everything is written, closed and flushed by then, and the process group destroyed. Teardown still frees
    what holds the group (the model's meshes, in reference cycles) while gloo's threads are ending, and now and
    then a rank then aborts with "terminate called without an active exception" (exit -6) after a finished run:
    seen in `generate --offload` under torchrun, and once at the end of an elastic restart's second attempt.
    """
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def in_multi_rank_run() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def close_process_group() -> None:
    """A world of one leaves no group behind after an error (in-process callers may start another run)."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        from qlora_fsdp.distributed.rank_errors import forget_store

        if dist.is_initialized():
            dist.destroy_process_group()
        forget_store()


def finish_progress_bars() -> None:
    """End this process's progress bars with their line, so the error starts a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", [])):
        bar.close()
