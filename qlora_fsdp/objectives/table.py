"""The one table from train.objective to the class that trains it. Real imports, not names in strings: a rename
fails on import, and an IDE and the import graph see each link. What validation asks of an objective before any
of this is imported (the data it reads, its default beta) is its row in config/objectives.py."""

from __future__ import annotations

from qlora_fsdp.config import Config
from qlora_fsdp.config.objectives import ObjectiveName
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.objectives.base import Objective
from qlora_fsdp.objectives.dft import Dft
from qlora_fsdp.objectives.grpo import Grpo
from qlora_fsdp.objectives.preference import Dpo, Kto, Orpo, RewardModel, Simpo
from qlora_fsdp.objectives.rloo import Rloo
from qlora_fsdp.objectives.supervised import Supervised

OBJECTIVE_CLASSES: dict[ObjectiveName, type[Objective]] = {
    "sft": Supervised, "dft": Dft, "dpo": Dpo, "orpo": Orpo, "simpo": Simpo, "kto": Kto, "reward": RewardModel,
    "grpo": Grpo, "rloo": Rloo}


def objective_class(cfg: Config) -> type[Objective]:
    return OBJECTIVE_CLASSES[cfg.train.objective]


def build_objective(cfg: Config, forward_loss: ForwardLoss) -> Objective:
    """The recipe's objective over training's forward and loss; a run then attaches its parts (Objective.attach),
    a plan runs its micro-step on fake tensors as it is."""
    return objective_class(cfg)(cfg, forward_loss)
