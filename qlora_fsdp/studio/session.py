"""The page's state and what each of its actions does, in plain Python (app.py maps them onto Gradio): the recipe
being edited, its plan, the run, the chat workers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlora_fsdp.config import Config, load_config
from qlora_fsdp.config.reference import yaml_value
from qlora_fsdp.errors import UserError
from qlora_fsdp.outputs.run_dir import METRICS_FILE
from qlora_fsdp.studio.chat import ChatWorkers
from qlora_fsdp.studio.draft import Draft, Resolved, extra_overrides, resolve, shipped_recipes, torchrun_command
from qlora_fsdp.studio.form import Field, changed_overrides, form_fields, form_values
from qlora_fsdp.studio.live import Progress, complete_records, curves, latest_completions, progress
from qlora_fsdp.studio.plan_worker import PlanData, PlanWorker
from qlora_fsdp.studio.recipe_cards import PlanRecords, card_markdown, picker_choices, recipe_card
from qlora_fsdp.studio.run_folders import FollowedRun, runs_under
from qlora_fsdp.studio.runs import Run, Runs

RANKS_KEY = "hardware.gpus_per_node"  # the launch's ranks on one node, and the world the plan is made for


@dataclass
class RunView:
    """What the Run tab shows; `changed` is False where the metrics file has not grown since the last look."""

    status: str
    progress: Progress
    series: dict[str, list[tuple[int, float]]]
    completions: list[list[Any]]
    log: str
    changed: bool
    seen: str  # the metrics file and its size at this look


class Studio:
    def __init__(self, state_dir: Path) -> None:
        self.fields: list[Field] = form_fields()
        self.plans = PlanWorker()
        self.runs = Runs(state_dir / "logs")
        self.chats = ChatWorkers()
        self.announced: set[str] = set()  # the runs (by process id) whose adapter the page has offered
        self.followed: FollowedRun | None = None  # a run folder the page follows in place of its own run
        self.cards = {name: recipe_card(name) for name in shipped_recipes()}
        self.plan_records = PlanRecords(state_dir / "plans.json")

    def recipe_of(self, recipe: str, yaml_path: str) -> str:
        """A YAML file given beside the picker wins over the picked name."""
        return yaml_path.strip() or recipe

    def load_recipe(self, recipe: str) -> tuple[Config | None, str]:
        """The recipe as written (the form's starting values), or its one-line error."""
        try:
            return load_config(recipe), ""
        except UserError as err:
            return None, f"error: {err}"

    def shown_recipe(self, recipe: str, yaml_path: str, shown: str) -> tuple[Config | None, str, str]:
        """What a pick or a path means for the form, which shows recipe `shown`: the new recipe's values to show,
        or None where the form keeps what it holds (the same recipe again, as after clearing a mistyped path: the
        user's edits stay; nothing picked; or the one-line error of a recipe that cannot load). Also the recipe
        the form then shows."""
        name = self.recipe_of(recipe or "", yaml_path)
        if not name:
            return None, "error: pick a recipe, or give the path of a YAML file", shown
        if name == shown:
            return None, "", shown
        cfg, error = self.load_recipe(name)
        return cfg, error, name if cfg is not None else shown

    def draft(self, recipe: str, values: list[Any], extra: str, ranks: int | None = None) -> tuple[Draft, str]:
        """The recipe and the overrides the form and the free-text box mean, and the ranks a launch starts (where
        they differ from the recipe's GPUs, `hardware.gpus_per_node` follows them, so the plan is of the world
        that will run); an error where the recipe cannot load."""
        base, error = self.load_recipe(recipe)
        if base is None:
            return Draft(recipe), error
        extra_lines = extra_overrides(extra)
        preset = [line for line in (*changed_overrides(base, self.fields, values), *extra_lines)
                  if line.partition("=")[0].strip() == "fsdp_preset"][-1:]
        if preset:  # a preset sets every fsdp key it names: the form's fsdp values count against the preset's
            try:
                base = load_config(recipe, preset)
            except UserError as err:
                return Draft(recipe), f"error: {err}"
        rest = [line for line in (*changed_overrides(base, self.fields, values), *extra_lines) if line not in preset]
        draft = Draft(recipe, (*preset, *rest))
        if any(line.partition("=")[0].strip() == RANKS_KEY for line in draft.overrides):
            return draft, ""  # set by hand: the key wins, and the ranks box shows it
        return with_ranks(draft, ranks), ""

    def resolved(self, recipe: str, values: list[Any], extra: str, ranks: int | None = None) -> Resolved:
        draft, error = self.draft(recipe, values, extra, ranks)
        return Resolved(draft, error=error) if error else resolve(draft)

    def command(self, resolved: Resolved) -> str:
        if resolved.config is None:
            return ""
        return torchrun_command(resolved.draft, resolved.config.hardware.gpus_per_node)  # the draft holds the ranks

    def plan(self, resolved: Resolved) -> PlanData | None:
        """The plan of the draft; None where a newer request replaced this one."""
        if resolved.config is None:
            return {"error": resolved.error}
        data = self.plans.plan(resolved.draft)
        if data is not None and resolved.draft.recipe in self.cards:
            self.plan_records.record(resolved.draft.recipe, resolved.draft.overrides, data)
        return data

    def picker_choices(self) -> list[tuple[str, str]]:
        return picker_choices(list(self.cards.values()), self.plan_records.read())

    def recipe_card(self, recipe: str, yaml_path: str) -> str:
        """The picked recipe's description, hardware, model and last plan ("" for a YAML file of one's own)."""
        name = self.recipe_of(recipe or "", yaml_path)
        return card_markdown(self.cards.get(name), self.plan_records.read().get(name))

    def with_lever(self, changes: dict[str, Any], values: list[Any], extra: str) -> tuple[list[Any], str]:
        """The form's values with a lever's keys set, as the form shows them (a checkbox's bool, else YAML), and
        the free-text overrides without those keys (they come after the form's and would undo the lever)."""
        out = list(values)
        for i, field in enumerate(self.fields):
            if field.key in changes:
                value = changes[field.key]
                out[i] = bool(value) if field.kind == "bool" else yaml_value(value)
        kept = [line for line in extra.splitlines() if line.partition("=")[0].strip() not in changes]
        return out, "\n".join(kept)

    def form_for(self, cfg: Config) -> list[Any]:
        return form_values(cfg, self.fields)

    def run_view(self, seen: str = "") -> RunView:
        """The run's state; its files are read again only where they changed since `seen` (the page's own last
        look: each open page keeps its own, as RunView.seen)."""
        run = self.shown_run()
        if run is None:
            return RunView("no run launched or followed from this page yet", Progress(), {}, [], "", False, seen)
        metrics = run.output_dir / "metrics.jsonl"
        now = f"{metrics}:{metrics.stat().st_size if metrics.is_file() else -1}"
        records = complete_records(metrics) if now != seen else []
        return RunView(run.status(), progress(records), curves(records), latest_completions(run.output_dir),
                       run.log_tail(), now != seen, now)

    def shown_run(self) -> Run | FollowedRun | None:
        """The run the Run tab shows: a followed folder, else the page's own run."""
        return self.followed if self.followed is not None else self.runs.current

    def follow(self, folder: str) -> str:
        """Follow any run folder (a terminal's, another studio's, one from before a restart): "" or why not."""
        path = Path(folder.strip()).expanduser()
        if not (path / METRICS_FILE).is_file():
            return f"error: {path} holds no {METRICS_FILE}: not a run folder (train.output_dir of a run)"
        self.followed = FollowedRun(path, self.runs.log_dir)
        return ""

    def launch(self, draft: Draft, ranks: int, resume: bool, visible_gpus: list[int] | None) -> Run:
        """The page's own run, which the Run tab then shows in place of a followed one."""
        run = self.runs.launch(draft, ranks, resume=resume, visible_gpus=visible_gpus)
        self.followed = None
        return run

    def new_adapter(self) -> str | None:
        """The adapter of the page's run once it has finished, the first time it is asked for."""
        run = self.runs.current
        if run is None or run.running or f"{run.process.pid}" in self.announced:
            return None
        adapter = run.output_dir / "adapter"
        if not (adapter / "adapter_config.json").is_file():
            return None
        self.announced.add(f"{run.process.pid}")
        return str(adapter)

    def close(self) -> None:
        self.plans.close()
        self.chats.close()
        self.runs.close()


def with_ranks(draft: Draft, ranks: int | None) -> Draft:
    """The draft on `ranks` processes of one node: `hardware.gpus_per_node` set where the recipe says otherwise
    (the tiny CPU recipes say 1 and train on two ranks); a draft that does not resolve is left as it is."""
    resolved = resolve(draft)
    if not ranks or resolved.config is None or resolved.config.hardware.nodes != 1:
        return draft
    hardware = resolved.config.hardware
    if ranks == hardware.gpus_per_node:
        return draft
    return draft.with_overrides([f"{RANKS_KEY}={ranks}"])


def run_choices(root: Path) -> list[tuple[str, str]]:
    """The runs under `root` for the follow picker: (what it is and how far it got, its folder), newest first."""
    return [(folder.words(), str(folder.path)) for folder in runs_under(root)]


def adapters_under(root: Path) -> list[str]:
    """Adapter folders of runs under `root` (OUTPUT_DIR/adapter), newest first."""
    found = [p for p in root.glob("**/adapter") if (p / "adapter_config.json").is_file()]
    return [str(p) for p in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)]
