"""Supervised fine-tuning (train.objective sft): next-token loss on the target tokens, with or without images.

The loss of an optimizer step is sum(token losses) / (target tokens in the whole effective batch, all
micro-batches, all ranks); FSDP sums gradients over ranks. So k micro-batches of m give exactly the
gradient of one batch of k*m, which a mean of per-micro-batch means does not.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qlora_fsdp.data.batching import Batch, Sample, collate, collate_packed
from qlora_fsdp.distributed import DistInfo, all_reduce_sum, all_reduce_sums
from qlora_fsdp.distributed.grad_sync import set_gradient_sync
from qlora_fsdp.distributed.row_groups import RowSplit
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.objectives.base import Objective, StepResult, eval_record, full_length_batches
from qlora_fsdp.objectives.row_shards import one_row_per_sample, shard_row, split_filler


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
            (forward_loss or ForwardLoss())(model, split_filler(pad_id, split.degree, split.index), info.device)
        else:  # keep the collectives in step with ranks that still have samples
            model(input_ids=torch.tensor([[pad_id]], device=info.device))
    model.train(was_training)
    summed, targets = all_reduce_sums([total, n_targets], info.device)
    return summed / max(targets, 1.0)


def eval_batch(samples: list[Sample], pad_id: int, split: RowSplit) -> Batch:
    if not split.splits:
        return collate(samples, pad_id)
    return shard_row(one_row_per_sample(samples, pad_id), split.degree, split.index, pad_id)


class Supervised(Objective):
    """Samples (with their images, where the records show some): padded micro-batches or packed rows."""

    def micro_batches(self) -> list[Batch]:
        """This rank's micro-batches for the next step: padded samples, or packed rows; under context parallel,
        this rank's part of them."""
        run = self.parts
        batches = self.whole_micro_batches()
        if not run.split.splits:
            return batches
        return [shard_row(batch, run.split.degree, run.split.index, run.pad_id) for batch in batches]

    def whole_micro_batches(self) -> list[Batch]:
        run = self.parts
        data, sampler = run.data, run.sampler
        assert sampler is not None, "a training run's objective draws from the loop's sampler"
        if data.packs is None:
            lay_out = one_row_per_sample if run.split.splits else collate
            return [lay_out(data.samples(data.train, units), run.pad_id) for units in sampler.next_step()]
        # rows padded to the context length: every step has one shape, so compiled layers never recompile (the
        # rows are nearly full anyway: 99.6% in benchmarks/training_speed.py)
        length = self.cfg.data.context_length
        return [collate_packed([data.samples(data.train, data.packs[u]) for u in units], run.pad_id, length)
                for units in sampler.next_step()]

    def step(self, loss_factor: float) -> StepResult:
        # looked up at call time: tests/fault_run.py wraps it to inject faults into a run's steps
        return accumulate_gradients(self.parts.model, self.micro_batches(), self.parts.info.device,
                                    self.forward_loss, loss_factor)

    @property
    def held_out_loss(self) -> ForwardLoss:
        """The loss the held-out record reports: the step's (DFT: the plain token loss)."""
        return self.forward_loss

    def evaluate(self, step: int) -> dict[str, float]:
        run = self.parts
        return eval_record(evaluate(run.model, self.held_out, self.cfg.data.eval_batch_size, run.pad_id, run.info,
                                    self.held_out_loss, run.split))

    def planned_batches(self) -> list[Batch]:
        return full_length_batches(self.cfg, self.planned_rows())

    def planned_micro_step(self, model: nn.Module, batch: Batch, device: torch.device) -> None:
        backward_micro_batch(model, batch, device, float(max(batch.n_targets, 1)), self.forward_loss)
