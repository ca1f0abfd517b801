"""The environment of the processes the page starts (plan and chat workers, torchrun)."""

from __future__ import annotations

import os

# a torch.distributed world's variables: a process that inherits them joins (or clashes with) that world's store
# instead of making its own; the chat workers each make a world of one on a free port
WORLD_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment without a distributed world's variables (a server started from inside a
    torchrun job, or a test process that made a world of one), plus `extra`."""
    kept = {key: value for key, value in os.environ.items()
            if key not in WORLD_VARIABLES and not key.startswith("TORCHELASTIC_")}
    return {**kept, **extra}
