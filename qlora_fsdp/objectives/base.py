"""What every training objective is to the loop and the planner: one class behind one protocol.

An objective is built from the recipe and training's forward (`Objective(cfg, forward_loss)`). The planner stops
there: it asks for the step's micro-batches at full length (`planned_batches`) and runs the objective's own
micro-step on fake tensors (`planned_micro_step`). A run then attaches what it made (the model, the data, the
sampler: `RunParts`), and the loop calls `prepare`, `step`, `evaluate`, `state` and `take_sample` without knowing
which objective it runs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from qlora_fsdp.config import Config
from qlora_fsdp.data.batching import Batch, Sample, StepSampler, collate, collate_packed
from qlora_fsdp.data.kinds import TrainingData
from qlora_fsdp.distributed import DistInfo
from qlora_fsdp.distributed.row_groups import RowSplit
from qlora_fsdp.generation.plan import GenerationPlan
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.objectives.row_shards import one_row_per_sample, shard_row


@dataclass
class StepResult:
    """One optimizer step's gradients, summed over its micro-batches and every rank."""

    loss: float
    n_targets: float
    n_tokens: float
    n_samples: float
    n_positions: float = 0.0  # tokens the model ran, real and padding
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RunParts:
    """What a training run gives its objective once the model is built and the data read."""

    info: DistInfo
    model: nn.Module
    data: TrainingData
    pad_id: int
    sampler: StepSampler | None  # the loop's: which units each step takes (its state is the loop's checkpoint's)
    split: RowSplit
    tokenizer: PreTrainedTokenizerBase | None = None  # the objectives that generate text decode with it
    write: Callable[[str], None] = print  # a line for the run's log (rank 0 shows it)


class Objective:
    """The protocol (and the defaults) every objective keeps."""

    # the micro-batches a plan runs: the first (no gradients yet, sync off), the last (sync on); a middle one adds
    # nothing (tested)
    PLANNED_MICRO_BATCHES = 2
    # the step's metrics the progress line shows, besides the loss, learning rate, gradient norm, speed and memory
    PROGRESS_METRICS: ClassVar[tuple[str, ...]] = ()
    # the held-out record's figures: the progress line shows them, the run's summary keeps each at start and end
    EVAL_METRICS: ClassVar[tuple[str, ...]] = ("eval_loss", "eval_ppl")
    # the recipe sections of its own settings (of config/objectives.py's OBJECTIVE_SECTIONS)
    SECTIONS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: Config, forward_loss: ForwardLoss) -> None:
        self.cfg, self.forward_loss = cfg, forward_loss
        self.run: RunParts | None = None

    @classmethod
    def check_before_loading(cls, cfg: Config) -> None:
        """What can fail before any weight is read (GRPO: an unknown reward function)."""

    def attach(self, run: RunParts) -> None:
        self.run = run

    @property
    def parts(self) -> RunParts:
        assert self.run is not None, "a run attaches its parts before the loop calls the objective"
        return self.run

    # ---- a run -------------------------------------------------------------------------------------------------

    def prepare(self, step: int) -> None:
        """Before the first step of this process (a resumed run too): what the steps need computed once."""

    def micro_batches(self) -> list[Batch]:
        """This rank's micro-batches of the next step, drawn from the sampler."""
        raise NotImplementedError(f"{type(self).__name__} draws its batches inside its step")

    def step(self, loss_factor: float) -> StepResult:
        """Forward and backward of the step's micro-batches (gradients reduce-scatter once, after the last); the
        loss scaled by `loss_factor` (float16's loss scale) before its backward."""
        raise NotImplementedError

    def has_eval(self) -> bool:
        return len(self.parts.data.eval) > 0

    @functools.cached_property
    def held_out(self) -> list[Sample]:
        """The held-out samples (a pair's two sequences in a row), read once."""
        data = self.parts.data
        return data.samples(data.eval, list(range(len(data.eval))))

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out record over every rank (a collective: every rank calls it)."""
        raise NotImplementedError

    def extra_forwards(self) -> int:
        """Forwards a step runs beyond the policy's (DPO's reference each micro-batch), for model FLOPs."""
        return 0

    def state(self) -> dict[str, Any] | None:
        """This rank's part of a checkpoint beyond weights, optimizer and sampler (GRPO's generation in use)."""
        return None

    def load_state(self, state: dict[str, Any] | None) -> None:
        pass

    def take_sample(self) -> dict[str, Any] | None:
        """A few of the step's completions for completions.jsonl, once; None for objectives that generate none."""
        return None

    # ---- a plan ------------------------------------------------------------------------------------------------

    def planned_rows(self) -> int:
        """Rows of a micro-batch's forward at full length."""
        return self.cfg.data.micro_batch

    def planned_extra_forwards(self) -> int:
        """extra_forwards as a plan counts them, without the data (the larger where the data decides)."""
        return 0

    def keeps_reference_adapter(self) -> bool:
        """Whether the starting adapter is kept frozen beside the trained one all run (a KL term's reference)."""
        return False

    def planned_generation(self) -> GenerationPlan | None:
        """What the objective generates each step (the plan prices its memory and time); None: nothing."""
        return None

    def planned_batches(self) -> list[Batch]:
        """The step's micro-batches at full length, laid out as training lays them out."""
        raise NotImplementedError

    def watch_forwards(self, hook: Callable[[], None]) -> None:
        """The planner's tracker: `hook()` after a forward that another forward of the model follows within the
        micro-batch (DPO's reference forward)."""

    def planned_micro_step(self, model: nn.Module, batch: Batch, device: torch.device) -> None:
        """One micro-batch's forward, loss and backward by the functions the step calls; the normalizers are this
        micro-batch's own (they do not change memory), and nothing reads a value (fake tensors have none)."""
        raise NotImplementedError


def eval_record(loss: float) -> dict[str, float]:
    """The held-out loss and its perplexity (NaN: no held-out set, or not evaluated)."""
    return {"eval_loss": loss, "eval_ppl": math.exp(loss) if math.isfinite(loss) else math.nan}


def full_length_batches(cfg: Config, rows: int) -> list[Batch]:
    """The step's micro-batches at full length (real tensors: transformers looks at their values to choose its
    attention mask). Where rows hold several samples (packing, a preference pair's two sequences) each holds two;
    padded micro-batches have a shorter last row, so the mask is built whenever real batches can need one. Under
    context parallel: the first part of each row, as rank 0 of a split holds it."""
    length = cfg.data.context_length
    sample = Sample(input_ids=[0] * length, labels=[0] * length)
    if cfg.several_samples_a_row:
        half = length // 2
        pair = [Sample(sample.input_ids[:half], sample.labels[:half]), Sample(sample.input_ids[half:],
                                                                               sample.labels[half:])]
        batch = collate_packed([pair] * rows, pad_id=0)
    else:
        shorter = Sample(sample.input_ids[:-1], sample.labels[:-1])
        batch = collate([sample] * (rows - 1) + [shorter if rows > 1 else sample], pad_id=0)
    if cfg.fsdp.context_parallel > 1:
        whole = batch if batch.position_ids is not None else one_row_per_sample([sample] * rows, pad_id=0)
        batch = shard_row(whole, cfg.fsdp.context_parallel, 0, pad_id=0)
    return [batch] * min(cfg.data.grad_accum_steps, Objective.PLANNED_MICRO_BATCHES)
