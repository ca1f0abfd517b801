"""The training loop: micro-batches, token-weighted loss, gradient sync on the last micro-batch, clip, step.

The loss of an optimizer step is sum(token losses) / (target tokens in the whole effective batch, all
micro-batches, all ranks); FSDP sums gradients over ranks. So k micro-batches of m give exactly the
gradient of one batch of k*m, which a mean of per-micro-batch means does not.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import peft
import torch
from torch import nn

from qlora_fsdp.config import PAIR_OBJECTIVES, Config, changed_settings
from qlora_fsdp.data.batching import Batch, Sample, StepSampler, collate, collate_packed
from qlora_fsdp.data.images import ImageData
from qlora_fsdp.data.pipeline import Dataset
from qlora_fsdp.data.prompts import PromptData
from qlora_fsdp.data.row_shards import one_row_per_sample, shard_row
from qlora_fsdp.data.templates import IGNORE_INDEX
from qlora_fsdp.distributed import DistInfo, all_reduce_maxes, all_reduce_sum, all_reduce_sums
from qlora_fsdp.distributed.row_groups import RowSplit, row_split
from qlora_fsdp.errors import TrainingStopped
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.losses.pairs import PairLoss
from qlora_fsdp.precision import uses_loss_scaling
from qlora_fsdp.training.checkpoints import Checkpointer
from qlora_fsdp.training.grad_sync import set_gradient_sync, sum_replicated_gradients
from qlora_fsdp.training.grpo_steps import GrpoSteps
from qlora_fsdp.training.loss_scale import LossScaler
from qlora_fsdp.training.metrics import MetricsLogger, StepWindow, memory_peaks_gib, reset_memory_peaks
from qlora_fsdp.training.optimizer import ShardedOptimizer, clip_grad_norm
from qlora_fsdp.training.pair_steps import accumulate_pair_gradients, evaluate_pairs, pair_rows, with_pair_extras
from qlora_fsdp.training.profiling import StepProfiler
from qlora_fsdp.training.records import REWARD_SUMMARY, MfuReference, RunSummary, StepResult, StepStats
from qlora_fsdp.training.reference_logps import reference_logps
from qlora_fsdp.training.signals import GracefulStop


def backward_micro_batch(model: nn.Module, batch: Batch, device: torch.device, normalizer: float,
                         forward_loss: ForwardLoss, loss_factor: float = 1.0) -> torch.Tensor:
    """Forward, loss (its share of the step's token-normalized loss) and backward of the loss times
    `loss_factor` (float16's loss scale); the detached, unscaled loss."""
    loss = forward_loss(model, batch, device) / normalizer
    (loss * loss_factor if loss_factor != 1.0 else loss).backward()
    return loss.detach()


def accumulate_gradients(model: nn.Module, micro_batches: list[Batch], device: torch.device,
                         forward_loss: ForwardLoss | None = None, loss_factor: float = 1.0) -> StepResult:
    """Forward and backward every micro-batch; gradients reduce-scatter once, after the last."""
    forward_loss = forward_loss or ForwardLoss()
    n_targets, n_tokens, n_samples, n_positions = all_reduce_sums(
        [sum(b.n_targets for b in micro_batches), sum(b.n_tokens for b in micro_batches),
         sum(b.n_samples for b in micro_batches), sum(b.input_ids.numel() for b in micro_batches)], device)
    local_loss = 0.0
    for index, batch in enumerate(micro_batches):
        set_gradient_sync(model, index == len(micro_batches) - 1)
        local_loss += backward_micro_batch(model, batch, device, max(n_targets, 1.0), forward_loss,
                                           loss_factor).item()
    aux = forward_loss.router.mean_added()  # a mixture of experts' load-balancing loss, where the config asks
    metrics = {"router_aux_loss": all_reduce_sum(aux, device) / all_reduce_sum(1.0, device)} if aux is not None else {}
    return StepResult(all_reduce_sum(local_loss, device), n_targets, n_tokens, n_samples, n_positions, metrics)


def accumulate_pairs(model: nn.Module, micro_batches: list[Batch], device: torch.device, pair_loss: PairLoss,
                     loss_factor: float = 1.0) -> StepResult:
    """accumulate_gradients for a preference objective: samples count pairs, the loss is the mean over pairs."""
    loss, totals, (n_tokens, n_targets, n_positions), metrics = accumulate_pair_gradients(
        model, micro_batches, device, pair_loss, loss_factor)
    return StepResult(loss, n_targets, n_tokens, totals.pairs, n_positions, metrics)


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # held-out batches vary in shape: compiled layers would recompile
def evaluate(model: nn.Module, samples: list[Sample], batch_size: int, pad_id: int, info: DistInfo,
             forward_loss: ForwardLoss | None = None, split: RowSplit | None = None) -> float:
    """Token-weighted held-out loss over all ranks; every rank runs the same number of forwards. Under context
    parallel the ranks sharing rows take the same samples, each its part of them."""
    split = split or RowSplit(1, 0, info.rank, info.world_size)
    # alike lengths batch up
    mine = sorted(samples, key=lambda s: len(s.input_ids))[split.data_rank :: split.data_ranks]
    n_batches = math.ceil(math.ceil(len(samples) / split.data_ranks) / batch_size)
    was_training = model.training
    model.eval()
    total, n_targets = 0.0, 0
    for index in range(n_batches):
        chunk = mine[index * batch_size : (index + 1) * batch_size]
        if chunk:
            batch = eval_batch(chunk, pad_id, split)
            total += (forward_loss or ForwardLoss())(model, batch, info.device).item()
            n_targets += batch.n_targets
        elif split.splits:  # a row of padding, split alike, keeps the collectives in step
            filler = Sample([pad_id] * split.degree, [IGNORE_INDEX] * split.degree)
            (forward_loss or ForwardLoss())(model, eval_batch([filler], pad_id, split), info.device)
        else:  # keep the collectives in step with ranks that still have samples
            model(input_ids=torch.tensor([[pad_id]], device=info.device))
    model.train(was_training)
    summed, targets = all_reduce_sums([total, n_targets], info.device)
    return summed / max(targets, 1.0)


def eval_batch(samples: list[Sample], pad_id: int, split: RowSplit) -> Batch:
    if not split.splits:
        return collate(samples, pad_id)
    return shard_row(one_row_per_sample(samples, pad_id), split.degree, split.index, pad_id)


def eval_record(loss: float) -> dict[str, float]:
    return {"eval_loss": loss, "eval_ppl": math.exp(loss) if math.isfinite(loss) else math.nan}


class Trainer:
    def __init__(self, cfg: Config, info: DistInfo, model: peft.PeftModel, data: Dataset | PromptData | ImageData,
                 pad_id: int,
                 optimizer: ShardedOptimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 logger: MetricsLogger, checkpointer: Checkpointer | None = None,
                 mfu_reference: MfuReference | None = None) -> None:
        self.cfg, self.info, self.model, self.data, self.pad_id = cfg, info, model, data, pad_id
        self.optimizer, self.scheduler, self.logger, self.checkpointer = optimizer, scheduler, logger, checkpointer
        grouped = cfg.data.group_by_length or data.packs is not None
        self.split = row_split(cfg.fsdp.context_parallel)  # the ranks sharing a row take the same units
        self.sampler = StepSampler(data.n_units, cfg.data.micro_batch, cfg.data.grad_accum_steps,
                                   self.split.data_ranks, self.split.data_rank, cfg.train.seed,
                                   lengths=data.unit_lengths() if grouped else None)
        self.eval_samples = data.samples(data.eval, list(range(len(data.eval))))
        self.step, self.skipped_steps, self.bad_in_a_row = 0, 0, 0
        self.last_checkpoint: Path | None = None
        self.window = StepWindow()  # the steps since the last metrics record
        self.stop = GracefulStop()
        self.profiler = StepProfiler(cfg.profile, Path(cfg.train.output_dir), info.rank, info.device)
        self.mfu_reference = mfu_reference or MfuReference()
        self.memory_peaks: dict[str, float] = {}  # the run's largest, over ranks
        self.forward_loss = ForwardLoss.for_config(cfg, info.device)
        self.pair_loss = PairLoss.for_config(cfg, info.device) if cfg.train.objective in PAIR_OBJECTIVES else None
        self.grpo: GrpoSteps | None = None  # train.objective grpo: api.make_trainer sets it (it needs the tokenizer)
        self.references: dict[str, torch.Tensor] | None = None  # DPO's, when computed before training
        paired = isinstance(data, Dataset) and data.pairs  # KTO's labels, a reward model's margins
        self.pair_extras = {name: Dataset.pair_extras(split) if paired else {}
                            for name, split in (("train", data.train), ("eval", data.eval))}
        self.scaler = LossScaler(uses_loss_scaling(cfg), cfg.optim.loss_scale_init,
                                 cfg.optim.loss_scale_growth_interval)
        if self.pair_loss is not None and self.pair_loss.needs_reference and not self.precomputes_reference():
            self.mfu_reference = self.mfu_reference.with_reference_forward()

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
        if self.grpo is not None:
            self.grpo.load_state(self.checkpointer.rank_state(checkpoint))
        self.last_checkpoint = checkpoint
        self.logger.log({"event": "resume", "step": self.step, "checkpoint": str(checkpoint)})
        self.logger.write(f"resumed from {checkpoint} at step {self.step}")
        changes = changed_settings((checkpoint / "config.yaml").read_text(), self.cfg)
        if changes:  # allowed (a longer run, a new lr), but the run is then not the uninterrupted one
            self.logger.write(f"settings changed since the checkpoint: {'; '.join(changes)}")

    def save(self) -> None:
        if self.checkpointer is not None:
            rank_state = self.grpo.state() if self.grpo is not None else None
            self.last_checkpoint = self.checkpointer.save(self.step, self.model, self.optimizer, self.state_dict(),
                                                          rank_state)
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
        return bool(self.eval_samples) or (self.grpo is not None and len(self.grpo.data.eval) > 0)

    def evaluate(self) -> dict[str, float]:
        """The held-out record: loss and perplexity; for preference pairs, loss and the reward metrics; for GRPO,
        the held-out prompts' rewards."""
        if self.grpo is not None:
            return self.grpo.evaluate(self.step)
        if self.pair_loss is not None:
            references = self.references["eval"] if self.references is not None else None
            return evaluate_pairs(self.model, self.eval_samples, self.cfg.data.eval_batch_size, self.pad_id,
                                  self.info, self.pair_loss, references, self.pair_extras["eval"])
        return eval_record(evaluate(self.model, self.eval_samples, self.cfg.data.eval_batch_size, self.pad_id,
                                    self.info, self.forward_loss, self.split))

    def precomputes_reference(self) -> bool:
        """DPO with preference.reference precomputed, or auto and a run that sees every training pair."""
        setting = self.cfg.preference.reference
        if self.pair_loss is None or not self.pair_loss.needs_reference or setting == "adapter_off":
            return False
        # the saved adapter, or trained routers (which no switch turns off): the reference is the start's model
        if setting == "precomputed" or self.cfg.model.adapter or self.cfg.lora.train_router:
            return True
        pairs_per_step = self.sampler.units_per_step * len(self.data.train) / self.data.n_units
        return self.cfg.train.max_steps * pairs_per_step >= len(self.data.train)

    def prepare_reference(self) -> None:
        if self.precomputes_reference() and self.references is None and self.pair_loss is not None:
            assert isinstance(self.data, Dataset), "a preference objective reads pairs"
            self.logger.write("reference log-probabilities: computed once before training (preference.reference)")
            self.references = reference_logps(self.cfg, self.model, self.data, self.pair_loss, self.pad_id,
                                              self.info, Path(self.cfg.train.output_dir), self.step)

    def pair_batch(self, pair_ids: list[int], rows: list[list[Sample]], length: int | None = None) -> Batch:
        batch = collate_packed(rows, self.pad_id, length)
        if self.references is not None:  # each pair's chosen, then its rejected sequence, as the rows hold them
            batch.reference_logps = self.references["train"][pair_ids].flatten()
        return with_pair_extras(batch, self.pair_extras["train"], pair_ids)

    def micro_batches(self) -> list[Batch]:
        """This rank's micro-batches for the next step: padded samples, or packed rows; under context parallel,
        this rank's part of them."""
        batches = self.whole_micro_batches()
        if not self.split.splits:
            return batches
        return [shard_row(batch, self.split.degree, self.split.index, self.pad_id) for batch in batches]

    def whole_micro_batches(self) -> list[Batch]:
        data = self.data
        if self.pair_loss is not None:  # a pair a row, its two sequences side by side, or packed rows of pairs
            if data.packs is None:
                return [self.pair_batch(units, pair_rows(data.samples(data.train, units)))
                        for units in self.sampler.next_step()]
            packs = data.packs
            return [self.pair_batch([p for u in units for p in packs[u]],
                                    [data.samples(data.train, packs[u]) for u in units], self.cfg.data.context_length)
                    for units in self.sampler.next_step()]
        if data.packs is None:
            lay_out = one_row_per_sample if self.split.splits else collate
            return [lay_out(data.samples(data.train, units), self.pad_id) for units in self.sampler.next_step()]
        # rows padded to the context length: every step has one shape, so compiled layers never recompile (the
        # rows are nearly full anyway: 99.6% in benchmarks/training_speed.py)
        length = self.cfg.data.context_length
        return [collate_packed([data.samples(data.train, data.packs[u]) for u in units], self.pad_id, length)
                for units in self.sampler.next_step()]

    def train_step(self) -> StepStats:
        """One optimizer step; a non-finite loss or gradient norm skips the update (the data is consumed). Under
        float16's loss scaling an overflow is expected now and then: the scale backs off, and the step does not
        count toward max_bad_steps while the scale is still at least 1."""
        micro_batches = self.micro_batches() if self.grpo is None else []  # grpo generates its own
        scale = self.scaler.factor
        if self.grpo is not None:  # the sampler's prompts, num_generations completions each
            result = self.grpo.step(self.sampler.next_step, scale)
        elif self.pair_loss is not None:
            result = accumulate_pairs(self.model, micro_batches, self.info.device, self.pair_loss, scale)
        else:
            result = accumulate_gradients(self.model, micro_batches, self.info.device, self.forward_loss, scale)
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
            if self.grpo is not None:
                self.logger.log_completions(self.step, self.grpo.take_sample())
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
            evaluated = "eval_loss" in record or "eval_reward" in record
            if save or stats.skipped or evaluated or self.step % cfg.log_every == 0:
                self.logger.log(self.window.take())
            shown = ("loss", "reward", "reward_accuracy", "reward_margin", "kl", "eval_loss", "eval_ppl",
                     "eval_reward", "eval_reward_accuracy", "lr", "grad_norm", "loss_scale", "tokens_per_s", "mfu",
                     "peak_memory_gib")
            self.logger.progress(self.step, {k: record[k] for k in shown if k in record})
            self.check_bad_steps(stats)
            if save:
                self.save()
            if stop:
                return tokens, samples, True
        return tokens, samples, False

    def train(self) -> RunSummary:
        self.prepare_reference()
        self.model.train()
        resumed = self.step > 0
        first = self.evaluate() if self.has_eval() and not resumed else eval_record(math.nan)
        first_eval = first.get("eval_loss", math.nan)
        rewards = {f"{key}_start": first[key] for key in REWARD_SUMMARY if key in first}
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
        final = self.evaluate() if self.has_eval() and not stopped else eval_record(math.nan)
        final_eval = final.get("eval_loss", math.nan)
        rewards.update({f"{key}_end": final[key] for key in REWARD_SUMMARY if key in final})
        if not stopped:
            self.logger.log({"step": self.step, **final})
        checkpoint = str(self.last_checkpoint) if self.last_checkpoint is not None else None
        return RunSummary(wall, self.step, self.skipped_steps, samples, int(tokens),
                          self.mfu_reference.mfu(tokens / wall), first_eval, final_eval,
                          self.memory_peaks or self.step_memory_peaks(), stopped_by_signal=stopped,
                          checkpoint=checkpoint,
                          overflow_steps=self.scaler.overflows if self.scaler.enabled else None,
                          eval_rewards=rewards)
