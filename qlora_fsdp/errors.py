"""User-facing errors: each message is one actionable line; train.py prints it and exits non-zero.

Kept free of heavy imports so a bad recipe is reported before torch or bitsandbytes load.
"""


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


class TrainingStopped(UserError, RuntimeError):
    """The run stopped itself (e.g. too many non-finite steps in a row); the message says what to do."""
