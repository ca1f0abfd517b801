"""What the recipe picker says of each shipped recipe: its header's description, the hardware and model it is for,
and the verdict and hours of its last plan (the page's own, kept across restarts in the state folder, else the
`Planned:` line of the recipe's header, which tests/test_plan.py holds equal to what `--plan` prints)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlora_fsdp.config import RECIPES_DIR, load_config
from qlora_fsdp.errors import UserError

HEADER_FIELD = re.compile(r"^#\s*[A-Z][a-z]+:\s")  # `# Plan:`, `# Launch:`, `# Planned:`, `# Decisions:`


@dataclass(frozen=True)
class RecipeCard:
    name: str
    description: str
    hardware: str
    model: str
    planned: str  # the header's `Planned:` verdict, "" where it has none (the tiny CPU recipes)


def header_lines(path: Path) -> list[str]:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


def described(path: Path) -> tuple[str, str]:
    """The header's description (its lines before the first `# Word:` field, without the leading name) and the
    first sentence of its `Planned:` field."""
    lines = header_lines(path)
    fields = [i for i, line in enumerate(lines) if HEADER_FIELD.match(line)]
    first = fields[0] if fields else len(lines)
    text = " ".join(line.lstrip("#").strip() for line in lines[:first])
    description = text.removeprefix(f"{path.stem}:").strip()
    planned = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("# Planned:")), "")
    return description, planned.split(" (--plan")[0]


def recipe_card(name: str) -> RecipeCard:
    path = RECIPES_DIR / f"{name}.yaml"
    description, planned = described(path)
    try:
        cfg = load_config(name)
    except UserError as err:  # a recipe that does not load is still listed, with its error
        return RecipeCard(name, description, f"error: {err}", "", planned)
    hardware = cfg.hardware
    gpus = "CPU" if hardware.gpu == "cpu" else f"{hardware.gpus_per_node}x {hardware.gpu}"
    where = gpus if hardware.nodes == 1 else f"{hardware.nodes} nodes x {gpus}"
    return RecipeCard(name, description, where, cfg.model.path, planned)


class PlanRecords:
    """The verdict and hours of the last plan of each recipe the page planned, in `path` (JSON)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, dict[str, Any]]:
        try:
            return dict(json.loads(self.path.read_text()))
        except (OSError, ValueError):  # none yet, or a file cut by a crash: the headers' verdicts stand
            return {}

    def record(self, recipe: str, overrides: tuple[str, ...], data: dict[str, Any]) -> None:
        if "error" in data:
            return
        records = self.read()
        records[recipe] = {"fits": data["fits"], "run_time": data.get("run_time", ""), "overrides": list(overrides),
                           "when": time.strftime("%Y-%m-%d %H:%M")}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(records, indent=1))
        partial.replace(self.path)  # whole or not at all


def verdict(card: RecipeCard, record: dict[str, Any] | None) -> str:
    if record is not None:
        words = "FITS" if record["fits"] else "DOES NOT FIT"
        run_time = f", {record['run_time']}" if record.get("run_time") else ""
        changed = " with " + " ".join(record["overrides"]) if record.get("overrides") else ""
        return f"{words}{run_time} (planned here {record['when']}{changed})"
    return f"{card.planned} (the recipe's header)" if card.planned else "not planned yet"


def picker_label(card: RecipeCard, record: dict[str, Any] | None) -> str:
    fits = "" if record is None else (" · FITS" if record["fits"] else " · DOES NOT FIT")
    if record is None and card.planned:
        fits = " · " + card.planned.split(":")[0]
    run_time = f" {record['run_time']}" if record is not None and record.get("run_time") else ""
    return f"{card.name} · {card.hardware}{fits}{run_time}"


def picker_choices(cards: list[RecipeCard], records: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """The picker's (label, value) pairs: the value stays the recipe's name, as the command line takes it."""
    return [(picker_label(card, records.get(card.name)), card.name) for card in cards]


def card_markdown(card: RecipeCard | None, record: dict[str, Any] | None) -> str:
    if card is None:  # a YAML file of the user's own
        return ""
    return (f"**{card.name}**: {card.description}  \nhardware: {card.hardware} · model: `{card.model}` · "
            f"last plan: {verdict(card, record)}")
