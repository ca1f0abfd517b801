"""User-facing errors: each message is one actionable line; the commands print it and exit non-zero
(qlora_fsdp.commands.exit).

Kept free of heavy imports so a bad recipe is reported before torch or bitsandbytes load.
"""

from __future__ import annotations


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


def first_line(err: BaseException) -> str:
    """An exception's message cut to its first line (its type's name if it has none): for one-line errors."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
