"""Training objectives: one module per kind (supervised, pairs, grpo), each one class behind the protocol in
base.py. The recipe's train.objective names its class through the one table, config/objectives.py."""

from __future__ import annotations

import importlib

from qlora_fsdp.config import Config
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.objectives.base import Objective


def objective_class(cfg: Config) -> type[Objective]:
    module, name = cfg.train.kind.step.split(":")
    found = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    assert issubclass(found, Objective), f"{cfg.train.kind.step} is not an Objective"
    return found


def build_objective(cfg: Config, forward_loss: ForwardLoss) -> Objective:
    """The recipe's objective over training's forward and loss; a run then attaches its parts (Objective.attach),
    a plan runs its micro-step on fake tensors as it is."""
    return objective_class(cfg)(cfg, forward_loss)
