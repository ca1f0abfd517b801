"""Optional experiment trackers (TensorBoard, Weights & Biases) fed from the same records as metrics.jsonl.

Neither is a dependency: each is imported only when a recipe asks for it, and a missing package is a one-line
error at start, on every rank, before any weight is read.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Protocol

from qlora_fsdp.config import LoggingConfig
from qlora_fsdp.errors import ConfigError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # setting -> the package it needs


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, init_args: dict[str, Any], out_dir: Path, run_config: dict[str, Any]) -> None:
        self.wandb = importlib.import_module("wandb")
        self.run = self.wandb.init(**{"dir": str(out_dir), "config": run_config, **init_args})

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def requested(cfg: LoggingConfig) -> list[str]:
    return [name for name, on in (("tensorboard", cfg.tensorboard), ("wandb", cfg.wandb is not None)) if on]


def check_available(cfg: LoggingConfig) -> None:
    """Fail early, and the same on every rank, when an asked-for tracker is not installed."""
    for name in requested(cfg):
        if importlib.util.find_spec(PACKAGES[name]) is None:
            setting = "logging.tensorboard: true" if name == "tensorboard" else "logging.wandb"
            raise ConfigError(f"{setting} needs the {PACKAGES[name]} package: pip install {PACKAGES[name]} "
                              "(or turn it off)")


def open_trackers(cfg: LoggingConfig, out_dir: Path, run_config: dict[str, Any]) -> list[Tracker]:
    trackers: list[Tracker] = []
    if cfg.tensorboard:
        trackers.append(TensorBoardTracker(out_dir / "tensorboard"))
    if cfg.wandb is not None:
        trackers.append(WandbTracker(cfg.wandb, out_dir, run_config))
    return trackers


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The plottable values of a metrics record (no step, time or event fields)."""
    return {k: float(v) for k, v in record.items()
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}
