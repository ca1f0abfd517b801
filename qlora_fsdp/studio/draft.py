"""A recipe as the page holds it: a shipped name or a YAML path, and its overrides; resolved into the config, its
YAML and the exact command that trains it, or into the command line's one-line error."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from qlora_fsdp.config import RECIPES_DIR, Config, load_config, merged_overrides, to_yaml
from qlora_fsdp.errors import UserError

CPU_RANKS = 2  # the tiny CPU recipes train on two gloo ranks, as `make demo` does


@dataclass(frozen=True)
class Draft:
    recipe: str  # a name in recipes/ or a path to a YAML file
    overrides: tuple[str, ...] = ()  # key=value, as the command line takes them

    def with_overrides(self, more: list[str]) -> Draft:
        """Later overrides of a key replace earlier ones (as on the command line, the last one wins)."""
        return Draft(self.recipe, tuple(merged_overrides(self.overrides, more)))


@dataclass
class Resolved:
    draft: Draft
    config: Config | None = None
    error: str = ""  # the command line's `error: ...` line
    notes: list[str] = field(default_factory=list)

    @property
    def yaml(self) -> str:
        return to_yaml(self.config) if self.config is not None else ""


def shipped_recipes() -> list[str]:
    """The recipes in recipes/, the tiny CPU ones (they run here) first."""
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    return sorted(names, key=lambda name: (not name.startswith("tiny_cpu"), name))


def extra_overrides(text: str) -> list[str]:
    """The free-text overrides box: one key=value a line, as a shell would pass it (a list value may hold
    spaces: `lora.target_modules=[q_proj, v_proj]`); blank lines and # comments are skipped."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def resolve(draft: Draft) -> Resolved:
    if not draft.recipe.strip():
        return Resolved(draft, error="error: pick a recipe, or give the path of a YAML file")
    try:
        return Resolved(draft, load_config(draft.recipe.strip(), list(draft.overrides)))
    except UserError as err:
        return Resolved(draft, error=f"error: {err}")


def default_ranks(cfg: Config) -> int:
    """Processes a launch starts: the recipe's GPUs on this node, or two CPU ranks for a CPU recipe."""
    return CPU_RANKS if cfg.hardware.gpu == "cpu" else cfg.hardware.gpus_per_node


def train_arguments(draft: Draft, resume: bool = False) -> list[str]:
    """train.py's arguments for the draft."""
    return ["--recipe", draft.recipe.strip(), *draft.overrides, *(["--resume"] if resume else [])]


def torchrun_command(draft: Draft, ranks: int, resume: bool = False) -> str:
    """The exact command a terminal would run for the same training."""
    words = ["torchrun", "--nproc_per_node", str(ranks), "train.py", *train_arguments(draft, resume)]
    return shlex.join(words)
