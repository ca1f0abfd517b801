"""User-facing errors: each message is one actionable line; train.py prints it and exits non-zero.

Kept free of heavy imports so a bad recipe is reported before torch or bitsandbytes load.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    """Base of every error that is the user's to fix (bad recipe, data, checkpoint or folder)."""


class ConfigError(UserError, ValueError):
    """A recipe or override problem."""


class DataError(UserError, ValueError):
    """A dataset problem, naming the file and line."""


class ModelLoadError(UserError, RuntimeError):
    """A checkpoint that cannot be used."""


class OutputExistsError(UserError, FileExistsError):
    """The output folder holds a previous run."""


class CheckpointError(UserError, RuntimeError):
    """A training checkpoint that cannot be resumed from."""


class CollectiveTimeoutError(UserError, RuntimeError):
    """A rank waited for the others longer than train.collective_timeout_minutes."""


class TrainingStopped(UserError, RuntimeError):
    """The run stopped itself (e.g. too many non-finite steps in a row); the message says what to do."""


def run_command(body: Callable[[], int]) -> int:
    """A command-line entry point's body; a UserError becomes one `error: ...` line on stderr and exit code 2."""
    try:
        return body()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
