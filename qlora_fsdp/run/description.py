"""A recipe resolved once into what a run (or a plan of one) computes with: `auto` dtypes for the device, the folder
the model's config.json is read from, that config, and, once the model is built, the batch.

Training describes its run on its own device (`describe_run`); the planner on the recipe's GPUs, reading a hub
model's shipped config.json (loading/checkpoint.py's shipped_config_folder), so a plan needs neither a download nor
weights (`planned_run`). Nothing else resolves dtypes; the folders are decided in
loading/checkpoint.py alone.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

from transformers import PretrainedConfig

from qlora_fsdp.config import Config
from qlora_fsdp.loading.checkpoint import load_hf_config, shipped_config_folder
from qlora_fsdp.precision import DeviceDescription, resolve_dtypes
from qlora_fsdp.run.accelerators import planned_device


@dataclass(frozen=True)
class RunDescription:
    """One recipe, resolved."""

    written: Config  # the recipe and its overrides as given (saved beside checkpoints and the adapter)
    cfg: Config  # what the run computes with: `auto` dtypes resolved for `device` (and its batch, after with_batch)
    device: DeviceDescription
    built: Config  # cfg as the model is built from it: model.path the folder its config.json is read from
    before_batch: Config | None = None  # cfg before the run's batch was resolved (for the start-up line)

    @functools.cached_property
    def hf_config(self) -> PretrainedConfig:
        """The architecture the run trains (a multimodal checkpoint's text model), read once."""
        return load_hf_config(self.built)

    def with_batch(self, cfg: Config) -> RunDescription:
        """The run once its micro-batch (`auto`: measured on the built model) and its scaled lr are decided."""
        return dataclasses.replace(self, cfg=cfg, built=cfg, before_batch=self.cfg)


def describe_run(cfg: Config, device: DeviceDescription) -> RunDescription:
    """A run on `device`: its checkpoint folder is model.path's own (fetched from the hub if it is an id)."""
    resolved = resolve_dtypes(cfg, device)
    return RunDescription(cfg, resolved, device, resolved)


def planned_run(cfg: Config) -> RunDescription:
    """The run a plan prices: on the recipe's GPUs (hardware.gpu), a hub model read from its shipped config.json.
    Described on a copy (a caller changing its config later changes no description); a plan describes its recipe
    once (measure/planning.py)."""
    written = copy.deepcopy(cfg)
    device = planned_device(cfg.hardware)
    resolved = resolve_dtypes(written, device)
    return RunDescription(written, resolved, device, with_config_folder(resolved, shipped_config_folder(cfg)))


def with_config_folder(cfg: Config, folder: Path | None) -> Config:
    return cfg if folder is None else dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(folder)))
