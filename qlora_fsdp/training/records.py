"""What the loop reports: a micro-batch's and a step's results, the run's summary, and the reference that turns
tokens/s into model FLOPs utilization."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MfuReference:
    """Model FLOP utilization: 6N FLOP a token (forward 2N, its recompute under checkpointing 2N, input gradients
    2N; the frozen base has no weight gradients) against the peak of all ranks; none on an unknown device."""

    flops_per_token: float = 0.0
    peak_flops: float = 0.0

    @classmethod
    def for_run(cls, base_parameters: int, peak_flops_per_device: float | None, world_size: int) -> MfuReference:
        if not peak_flops_per_device:
            return cls()
        return cls(6.0 * base_parameters, peak_flops_per_device * world_size)

    def mfu(self, tokens_per_s: float) -> float | None:
        return tokens_per_s * self.flops_per_token / self.peak_flops if self.peak_flops else None

    def with_forwards(self, extra: int) -> MfuReference:
        """`extra` forwards more each micro-batch without gradients (DPO's reference, the adapter off): 2N each."""
        return dataclasses.replace(self, flops_per_token=self.flops_per_token * (6.0 + 2.0 * extra) / 6.0)


@dataclass(frozen=True)
class StepStats:
    """One optimizer step, global over ranks."""

    loss: float
    lr: float
    grad_norm: float
    tokens: float
    target_tokens: float
    samples: float
    skipped: bool
    positions: float = 0.0  # tokens the model ran: real ones and padding
    loss_scale: float | None = None  # float16 runs: the scale this step's backward used
    metrics: dict[str, float] = field(default_factory=dict)  # preference objectives: rewards, margin, accuracy

    def record(self) -> dict[str, float]:
        """The fields metrics.jsonl keeps for a step."""
        record = {"loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm, "tokens": self.tokens,
                  "target_tokens": self.target_tokens, "positions": self.positions, "skipped": int(self.skipped),
                  **self.metrics}
        return record if self.loss_scale is None else {**record, "loss_scale": self.loss_scale}


@dataclass
class RunSummary:
    """The end of a run; `as_dict` is the summary record, the printed table and what `train()` returns."""

    train_runtime_s: float
    steps: int
    skipped_steps: int
    samples: int
    tokens: int
    mfu: float | None
    held_out: dict[str, float]  # the objective's held-out figures at the start and the end (`eval_loss_start`, ...)
    memory_peaks_gib: dict[str, float]
    stopped_by_signal: bool = False
    checkpoint: str | None = None
    adapter: str | None = None
    profile: str | None = None
    loss_curves: str | None = None
    overflow_steps: int | None = None  # float16 runs: steps skipped because their gradients overflowed

    def as_dict(self) -> dict[str, Any]:
        wall = self.train_runtime_s
        out: dict[str, Any] = {"train_runtime_s": wall, "steps": self.steps, "skipped_steps": self.skipped_steps,
                               # counts as ints, so the record and the printed table show 5204, not 5204.0
                               "samples": int(self.samples), "samples_per_s": self.samples / wall,
                               "tokens": int(self.tokens), "tokens_per_s": self.tokens / wall}
        if self.mfu is not None:
            out["mfu"] = self.mfu
        out.update(self.held_out)
        out.update({f"{key}_max_rank": value for key, value in self.memory_peaks_gib.items()})
        if self.stopped_by_signal:
            out["stopped_by_signal"] = True
        if self.overflow_steps is not None:
            out["overflow_steps"] = self.overflow_steps
        for key in ("checkpoint", "adapter", "profile", "loss_curves"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

