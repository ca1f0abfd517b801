"""The training loop: the objective's step (its micro-batches, gradients synced once), clip, update, log, evaluate,
checkpoint, and stop on a signal or too many bad steps. The loop does not know which objective it runs: the
objective (qlora_fsdp/objectives/) makes its batches, its loss and its held-out record."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import peft
import torch

from qlora_fsdp.config import Config, changed_settings
from qlora_fsdp.data.batching import Batch, StepSampler
from qlora_fsdp.data.kinds import TrainingData
from qlora_fsdp.distributed import DistInfo, all_reduce_maxes
from qlora_fsdp.distributed.grad_sync import sum_replicated_gradients
from qlora_fsdp.distributed.row_groups import row_split
from qlora_fsdp.errors import TrainingStopped
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.objectives.base import Objective, RunParts
from qlora_fsdp.objectives.table import build_objective
from qlora_fsdp.optimizer import ShardedOptimizer, clip_grad_norm
from qlora_fsdp.outputs.checkpoints import Checkpointer
from qlora_fsdp.outputs.metrics import MetricsLogger, StepWindow, memory_peaks_gib, reset_memory_peaks
from qlora_fsdp.precision import uses_loss_scaling
from qlora_fsdp.training.loss_scale import LossScaler
from qlora_fsdp.training.profiling import StepProfiler
from qlora_fsdp.training.records import MfuReference, RunSummary, StepStats
from qlora_fsdp.training.signals import GracefulStop


class Trainer:
    def __init__(self, cfg: Config, info: DistInfo, model: peft.PeftModel, data: TrainingData, pad_id: int,
                 optimizer: ShardedOptimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 logger: MetricsLogger, checkpointer: Checkpointer | None = None,
                 mfu_reference: MfuReference | None = None, objective: Objective | None = None,
                 tokenizer: Any = None) -> None:
        self.cfg, self.info, self.model, self.data, self.pad_id = cfg, info, model, data, pad_id
        self.optimizer, self.scheduler, self.logger, self.checkpointer = optimizer, scheduler, logger, checkpointer
        grouped = cfg.data.group_by_length or data.packs is not None
        self.split = row_split(cfg.fsdp.context_parallel)  # the ranks sharing a row take the same units
        self.sampler = StepSampler(data.n_units, cfg.data.micro_batch, cfg.data.grad_accum_steps,
                                   self.split.data_ranks, self.split.data_rank, cfg.train.seed,
                                   lengths=data.unit_lengths() if grouped else None)
        self.step, self.skipped_steps, self.bad_in_a_row = 0, 0, 0
        self.last_checkpoint: Path | None = None
        self.window = StepWindow()  # the steps since the last metrics record
        self.stop = GracefulStop()
        self.profiler = StepProfiler(cfg.profile, Path(cfg.train.output_dir), info.rank, info.device)
        self.memory_peaks: dict[str, float] = {}  # the run's largest, over ranks
        self.forward_loss = ForwardLoss.for_config(cfg, info.device)
        self.objective = objective or build_objective(cfg, self.forward_loss)
        self.objective.attach(RunParts(info, model, data, pad_id, self.sampler, self.split, tokenizer, logger.write))
        self.scaler = LossScaler(uses_loss_scaling(cfg), cfg.optim.loss_scale_init,
                                 cfg.optim.loss_scale_growth_interval)
        self.mfu_reference = (mfu_reference or MfuReference()).with_forwards(self.objective.extra_forwards())

    def micro_batches(self) -> list[Batch]:
        """This rank's micro-batches for the next step, as the objective draws them."""
        return self.objective.micro_batches()

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs besides weights, optimizer state and RNG (those go through DCP)."""
        return {"sampler": self.sampler.state_dict(), "scheduler": self.scheduler.state_dict(),
                "skipped_steps": self.skipped_steps, "bad_in_a_row": self.bad_in_a_row,
                "loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.skipped_steps, self.bad_in_a_row = state["step"], state["skipped_steps"], state["bad_in_a_row"]
        self.sampler.load_state_dict(state["sampler"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state.get("loss_scaler", {}))  # checkpoints before float16 support have none
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr

    def resume(self, checkpoint: Path) -> None:
        assert self.checkpointer is not None, "resuming reads a checkpoint; api.make_trainer always makes one"
        self.load_state_dict(self.checkpointer.load(checkpoint, self.model, self.optimizer))
        self.objective.load_state(self.checkpointer.rank_state(checkpoint))
        self.last_checkpoint = checkpoint
        self.logger.log({"event": "resume", "step": self.step, "checkpoint": str(checkpoint)})
        self.logger.write(f"resumed from {checkpoint} at step {self.step}")
        changes = changed_settings((checkpoint / "config.yaml").read_text(), self.cfg)
        if changes:  # allowed (a longer run, a new lr), but the run is then not the uninterrupted one
            self.logger.write(f"settings changed since the checkpoint: {'; '.join(changes)}")

    def save(self) -> None:
        if self.checkpointer is not None:
            self.last_checkpoint = self.checkpointer.save(self.step, self.model, self.optimizer, self.state_dict(),
                                                          self.objective.state())
            self.logger.log({"event": "checkpoint", "step": self.step, "path": str(self.last_checkpoint)})

    def step_memory_peaks(self) -> dict[str, float]:
        """This step's peak memory, the largest over ranks; reset for the next step, kept for the summary."""
        local = memory_peaks_gib(self.info.device)
        peaks = dict(zip(local, all_reduce_maxes(list(local.values()), self.info.device), strict=True))
        reset_memory_peaks(self.info.device)
        for key, value in peaks.items():
            self.memory_peaks[key] = max(value, self.memory_peaks.get(key, 0.0))
        return peaks

    def has_eval(self) -> bool:
        return self.objective.has_eval()

    def evaluate(self) -> dict[str, float]:
        """The held-out record, the objective's (its EVAL_METRICS among its figures)."""
        return self.objective.evaluate(self.step)

    def train_step(self) -> StepStats:
        """One optimizer step; a non-finite loss or gradient norm skips the update (the data is consumed). Under
        float16's loss scaling an overflow is expected now and then: the scale backs off, and the step does not
        count toward max_bad_steps while the scale is still at least 1."""
        scale = self.scaler.factor
        result = self.objective.step(scale)
        sum_replicated_gradients(self.model)  # a trained image side, whole on every rank
        self.scaler.unscale_(self.model)
        grad_norm = clip_grad_norm(self.model, self.cfg.optim.max_grad_norm)
        lr = float(self.scheduler.get_last_lr()[0])  # torch types it float | Tensor; with a float lr it is a float
        finite = math.isfinite(result.loss) and math.isfinite(grad_norm)  # both global: every rank agrees
        overflow_handled = self.scaler.update(grad_norm) and math.isfinite(result.loss) and scale >= 1.0
        if finite:
            self.optimizer.step()
        self.skipped_steps += not finite
        self.bad_in_a_row = 0 if finite or overflow_handled else self.bad_in_a_row + 1
        self.scheduler.step()
        self.optimizer.zero_grad()
        return StepStats(result.loss, lr, grad_norm, result.n_tokens, result.n_targets, result.n_samples, not finite,
                         result.n_positions, scale if self.scaler.enabled else None, result.metrics)

    def check_bad_steps(self, stats: StepStats) -> None:
        if self.bad_in_a_row < self.cfg.train.max_bad_steps:
            return
        kept = self.last_checkpoint or "none yet (the weights in memory are the last good ones)"
        raise TrainingStopped(
            f"stopping at step {self.step}: {self.bad_in_a_row} steps in a row had a non-finite loss or gradient "
            f"(loss {stats.loss}, grad norm {stats.grad_norm}); last good checkpoint: {kept}; lower "
            "optim.lr or check the data, then resume with --resume")

    def run_steps(self) -> tuple[float, int, bool]:
        """Steps until max_steps or a signal; returns (tokens, samples, stopped by a signal)."""
        cfg = self.cfg.train
        tokens, samples = 0.0, 0
        while self.step < cfg.max_steps:
            step_start = time.perf_counter()
            stats = self.train_step()
            elapsed = time.perf_counter() - step_start
            self.profiler.step_done()
            self.step += 1
            self.logger.log_completions(self.step, self.objective.take_sample())
            tokens += stats.tokens
            samples += int(stats.samples)
            rate = stats.tokens / elapsed
            mfu = self.mfu_reference.mfu(rate)
            record = {"step": self.step, **stats.record(), "tokens_per_s": rate,
                      **({"mfu": mfu} if mfu is not None else {}), "step_time_s": elapsed}
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step != cfg.max_steps and self.has_eval():
                record.update(self.evaluate())
            record.update(self.step_memory_peaks())
            offloader = self.forward_loss.offloader
            if offloader is not None:  # host bytes what checkpointing kept took at their peak, this step
                record["activation_offload_gib"] = offloader.stats.peak_host_bytes / 2**30
                offloader.reset()
            stop = self.stop.requested(self.info.device)
            save = stop or self.step == cfg.max_steps or (cfg.save_every and self.step % cfg.save_every == 0)
            if stats.skipped and self.window.records:  # a skipped step's record stands alone, not averaged into NaN
                self.logger.log(self.window.take())
            self.window.add(record)
            # a checkpoint ends a record too: a resumed run then logs the same records as an uninterrupted one
            evaluated = any(key in record for key in self.objective.EVAL_METRICS)
            if save or stats.skipped or evaluated or self.step % cfg.log_every == 0:
                self.logger.log(self.window.take())
            shown = ("loss", *self.objective.PROGRESS_METRICS, *self.objective.EVAL_METRICS, "lr", "grad_norm",
                     "loss_scale", "tokens_per_s", "mfu", "peak_memory_gib")
            self.logger.progress(self.step, {k: record[k] for k in shown if k in record})
            self.check_bad_steps(stats)
            if save:
                self.save()
            if stop:
                return tokens, samples, True
        return tokens, samples, False

    def train(self) -> RunSummary:
        self.objective.prepare(self.step)
        self.model.train()
        resumed = self.step > 0
        first = self.evaluate() if self.has_eval() and not resumed else self.not_evaluated()
        if not resumed:
            self.logger.log({"step": 0, **first})
        start = time.perf_counter()
        self.stop.install()
        self.profiler.start()
        try:
            tokens, samples, stopped = self.run_steps()
        finally:
            self.profiler.stop()
            self.stop.uninstall()
        wall = time.perf_counter() - start
        final = self.evaluate() if self.has_eval() and not stopped else self.not_evaluated()
        if not stopped:
            self.logger.log({"step": self.step, **final})
        checkpoint = str(self.last_checkpoint) if self.last_checkpoint is not None else None
        return RunSummary(wall, self.step, self.skipped_steps, samples, int(tokens),
                          self.mfu_reference.mfu(tokens / wall), self.held_out_summary(first, final),
                          self.memory_peaks or self.step_memory_peaks(), stopped_by_signal=stopped,
                          checkpoint=checkpoint,
                          overflow_steps=self.scaler.overflows if self.scaler.enabled else None)

    def not_evaluated(self) -> dict[str, float]:
        return dict.fromkeys(self.objective.EVAL_METRICS, math.nan)

    def held_out_summary(self, first: dict[str, float], final: dict[str, float]) -> dict[str, float]:
        """Each of the objective's held-out figures at the start and the end (NaN: not evaluated then)."""
        summary = {}
        for key in self.objective.EVAL_METRICS:
            summary.update({f"{key}_start": first.get(key, math.nan), f"{key}_end": final.get(key, math.nan)})
        return summary
