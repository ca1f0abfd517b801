"""What a running (or finished) run has written, read while it writes: metrics.jsonl and completions.jsonl by
complete lines only (a line the run is still writing is left for the next read), as curves, progress and the
latest completions."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qlora_fsdp.outputs.metrics import format_duration
from qlora_fsdp.outputs.plots import Series, complete_records, metric_panels, objective_metrics, series_of

CURVE_KEYS = ("loss", "eval_loss", "tokens_per_s", "generated_tokens_per_s", "peak_memory_gib")


def curves(records: list[dict[str, Any]]) -> dict[str, Series]:
    """The studio's curves by step: loss and eval loss, each metric the run's objective names in its start record
    (GRPO's reward and KL, DPO's reward accuracy, KTO's KL, ...), tokens/s and memory."""
    named = tuple(key for _, keys in metric_panels(*objective_metrics(records)) for key in keys)
    return series_of(records, (*CURVE_KEYS, *named))


@dataclass
class Progress:
    step: int = 0
    max_steps: int | None = None
    seconds_a_step: float | None = None  # over the steps since the latest start or resume
    finished: bool = False
    stopped_by_signal: bool = False
    latest: dict[str, float] = field(default_factory=dict)  # the latest step record's numbers

    @property
    def seconds_left(self) -> float | None:
        if self.max_steps is None or self.seconds_a_step is None or self.finished:
            return None
        return max(self.max_steps - self.step, 0) * self.seconds_a_step

    def words(self) -> str:
        """One line: step, the latest values and the time left (the page's text beside its curves)."""
        if self.max_steps is None:
            return "no records yet"
        parts = [f"step {self.step}/{self.max_steps}"]
        for key in ("loss", "eval_loss", "reward", "tokens_per_s"):
            if key in self.latest:
                parts.append(f"{key} {self.latest[key]:.4g}")
        if self.finished:
            parts.append("stopped by a signal: resume to continue" if self.stopped_by_signal else "finished")
        elif self.seconds_left is not None:
            parts.append(f"about {format_duration(self.seconds_left)} left")
        return " · ".join(parts)


def progress(records: list[dict[str, Any]]) -> Progress:
    state = Progress()
    since: tuple[int, float] | None = None  # (step, time) at the latest start or resume
    for record in records:
        event = record.get("event")
        if event == "start":
            state.max_steps = int(record["config"]["train"]["max_steps"])
            since = (0, record["time"])
        elif event == "resume":  # the run goes on: a stop before it no longer ends it
            since = (int(record["step"]), record["time"])
            state.finished = state.stopped_by_signal = False
        elif event == "summary":
            state.finished, state.stopped_by_signal = True, bool(record.get("stopped_by_signal"))
        elif event is None and "step" in record and "loss" in record:
            state.step = int(record["step"])
            state.latest = {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k != "time"}
            if since is not None and state.step > since[0]:
                state.seconds_a_step = (record["time"] - since[1]) / (state.step - since[0])
        elif event is None and "step" in record:  # an eval record: its values beside the step's
            state.latest.update({k: float(v) for k, v in record.items() if k.startswith("eval_")
                                 and isinstance(v, (int, float))})
    return state


def message_text(message: Any) -> str:
    """A completion or prompt as text: a string, or chat messages (role: content, one a line)."""
    if isinstance(message, str):
        return message
    if isinstance(message, list):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else message_text(m)
                         for m in message)
    return str(message)


def latest_completions(run_dir: Path) -> list[list[Any]]:
    """GRPO: the latest logged step's completions as table rows [step, prompt, completion, reward]."""
    records = complete_records(run_dir / "completions.jsonl")
    if not records:
        return []
    last = records[-1]
    rewards = last.get("rewards") or [None] * len(last.get("completions", []))
    return [[last.get("step"), message_text(last.get("prompt", "")), message_text(completion), reward]
            for completion, reward in zip(last.get("completions", []), rewards, strict=False)]
