"""Preference tuning (train.objective dpo, orpo, simpo, kto, reward): its step and evaluation, the pairs'
counterparts of supervised.accumulate_gradients and evaluate.

The step's loss is the mean over the pairs of the whole effective batch: the pairs (and, for ORPO, the chosen
completions' target tokens) are counted over every micro-batch and rank first, then each micro-batch adds its share.
k micro-batches then give one batch's gradient, and sharded runs the unsharded one's.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from qlora_fsdp.data.batching import Batch, Sample, collate_packed
from qlora_fsdp.distributed import DistInfo, all_reduce_sums
from qlora_fsdp.distributed.grad_sync import set_gradient_sync
from qlora_fsdp.distributed.row_groups import RowSplit
from qlora_fsdp.losses.pair_losses import PairCounts, PairLoss, adapter_off, pair_counts
from qlora_fsdp.objectives.base import StepResult
from qlora_fsdp.objectives.row_shards import row_part, split_filler


def with_pair_extras(batch: Batch, extras: dict[str, list], pair_ids: list[int]) -> Batch:
    """The batch with its pairs' extra columns (KTO's labels, a reward model's margins) as tensors, in pair order."""
    for column, values in extras.items():
        setattr(batch, column, torch.tensor([values[p] for p in pair_ids]))
    return batch


def pair_rows(sequences: list[Sample]) -> list[list[Sample]]:
    """Each pair's two sequences (chosen, then rejected) as one row."""
    return [sequences[i : i + 2] for i in range(0, len(sequences), 2)]


def step_totals(micro_batches: list[Batch], device: torch.device, extra: list[float]) -> tuple[PairCounts, list[float]]:
    """The pairs, chosen targets and desirable records of the whole step (all micro-batches, all ranks), and `extra`
    summed alike."""
    counts = [pair_counts(b) for b in micro_batches]
    reduced = all_reduce_sums([sum(c[i] for c in counts) for i in range(3)] + extra, device)
    return PairCounts(reduced[0], reduced[1], reduced[2]), reduced[3:]


def with_kl(totals: PairCounts, model: nn.Module, batches: list[Batch], n_forwards: int, pair_loss: PairLoss,
            pad_id: int, device: torch.device, split: RowSplit | None = None) -> PairCounts:
    """KTO's totals with the step's z0: a first pass over the micro-batches (`n_forwards` of them on the busiest
    rank; a rank with fewer runs idle forwards), every rank's mismatched sequences averaged, clamped at 0."""
    if not pair_loss.kl_pass:
        return totals
    summed, count = 0.0, 0.0
    for index in range(n_forwards):
        if index < len(batches):
            part, n = pair_loss.kl_sums(model, batches[index], device)
            if batches[index].counts_once():  # a split row's sums are whole on each of its ranks
                summed, count = summed + part, count + n
        else:
            idle_forwards(model, pair_loss, pad_id, device, split)
    summed, count = all_reduce_sums([summed, count], device)
    return dataclasses.replace(totals, kl=max(summed / max(count, 1.0), 0.0))


def averaged(sums: dict[str, float], totals: PairCounts, device: torch.device) -> dict[str, float]:
    """Metric sums over all ranks, each divided by what it is counted in."""
    keys = sorted(sums)
    reduced = all_reduce_sums([sums[k] for k in keys], device)
    return {k: v / totals.denominator(k) for k, v in zip(keys, reduced, strict=True)}


def accumulate_pair_gradients(model: nn.Module, micro_batches: list[Batch], device: torch.device, pair_loss: PairLoss,
                              loss_factor: float = 1.0) -> tuple[float, PairCounts, list[float], dict[str, float]]:
    """Forward and backward every micro-batch of pairs (gradients reduce-scatter once, after the last); returns the
    step's loss, its counts, its (tokens, target tokens, positions) and its averaged metrics."""
    totals, (n_tokens, n_targets, n_positions) = step_totals(
        micro_batches, device, [sum(b.n_tokens for b in micro_batches), sum(b.n_targets for b in micro_batches),
                                sum(b.input_ids.numel() for b in micro_batches)])
    totals = with_kl(totals, model, micro_batches, len(micro_batches), pair_loss, 0, device)
    local_loss, sums = 0.0, dict.fromkeys(pair_loss.metric_names(), 0.0)
    for index, batch in enumerate(micro_batches):
        set_gradient_sync(model, index == len(micro_batches) - 1)
        loss, metrics = pair_loss(model, batch, device, totals)
        (loss * loss_factor if loss_factor != 1.0 else loss).backward()
        local_loss += counted(batch, loss.item(), metrics, sums)
    metrics = averaged(sums, totals, device)
    (loss_sum,) = all_reduce_sums([local_loss], device)
    return loss_sum, totals, [n_tokens, n_targets, n_positions], metrics


def accumulate_pairs(model: nn.Module, micro_batches: list[Batch], device: torch.device, pair_loss: PairLoss,
                     loss_factor: float = 1.0) -> StepResult:
    """accumulate_gradients for a preference objective: samples count pairs, the loss is the mean over pairs."""
    loss, totals, (n_tokens, n_targets, n_positions), metrics = accumulate_pair_gradients(
        model, micro_batches, device, pair_loss, loss_factor)
    return StepResult(loss, n_targets, n_tokens, totals.pairs, n_positions, metrics)


def counted(batch: Batch, loss: float, metrics: dict[str, float], sums: dict[str, float]) -> float:
    """The micro-batch's loss, its metrics added to `sums`, as the step counts them: every rank of a split row
    computes the whole row's, and its first part counts them."""
    if not batch.counts_once():
        return 0.0
    for key, value in metrics.items():
        sums[key] += value
    return loss


def idle_forwards(model: nn.Module, pair_loss: PairLoss, pad_id: int, device: torch.device,
                  split: RowSplit | None = None) -> None:
    """The forwards a rank with no pairs left runs, so its collectives stay in step with the others' (a split's
    ranks run them together, on a row of padding split alike)."""
    if split is not None and split.splits:
        filler = split_filler(pad_id, split.degree, split.index)
        if pair_loss.needs_reference:
            with adapter_off(model):
                pair_loss.forward.per_sample(model, filler, device)
        pair_loss.forward.per_sample(model, filler, device)
        return
    tiny = torch.tensor([[pad_id]], device=device)
    if pair_loss.needs_reference:
        with adapter_off(model):
            model(input_ids=tiny)
    model(input_ids=tiny)


def held_out_batches(sequences: list[Sample], batch_size: int, split: RowSplit) -> tuple[list[list[int]], int]:
    """This rank's held-out pairs (its split's), batch by batch (pair indices, alike lengths together), and how
    many batches the rank with the most runs. The reference pass over the held-out pairs batches them the same
    way, so that at the start its log-probabilities are the policy's to the bit (rewards tie exactly)."""
    pairs = pair_rows(sequences)
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0].input_ids) + len(pairs[i][1].input_ids))
    mine = order[split.data_rank :: split.data_ranks]
    n_batches = math.ceil(math.ceil(len(pairs) / split.data_ranks) / batch_size)
    return [mine[i * batch_size : (i + 1) * batch_size] for i in range(n_batches)
            if mine[i * batch_size : (i + 1) * batch_size]], n_batches


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # held-out batches vary in shape
def evaluate_pairs(model: nn.Module, sequences: list[Sample], batch_size: int, pad_id: int, info: DistInfo,
                   pair_loss: PairLoss, references: torch.Tensor | None = None,
                   extras: dict[str, list] | None = None, split: RowSplit | None = None) -> dict[str, float]:
    """Held-out loss (the mean over pairs, as in training) and reward metrics, over all ranks. `references`: the
    pairs' reference log-probabilities (pairs, 2) where they were computed before training; `extras`: the pairs'
    other columns (Dataset.pair_extras); `split`: rows split over ranks (context parallel)."""
    split = split or RowSplit(1, 0, info.rank, info.world_size)
    pairs = pair_rows(sequences)
    chunks, n_batches = held_out_batches(sequences, batch_size, split)
    batches = []
    for ids in chunks:
        batch = collate_packed([pairs[p] for p in ids], pad_id)
        if references is not None:
            batch.reference_logps = references[ids].flatten()
        batches.append(row_part(with_pair_extras(batch, extras or {}, ids), split, pad_id))
    totals, _ = step_totals(batches, info.device, [])
    was_training = model.training
    model.eval()
    totals = with_kl(totals, model, batches, n_batches, pair_loss, pad_id, info.device, split)
    loss, sums = 0.0, dict.fromkeys(pair_loss.metric_names(), 0.0)
    for index in range(n_batches):
        if index < len(batches):
            share, metrics = pair_loss(model, batches[index], info.device, totals)
            loss += counted(batches[index], share.item(), metrics, sums)
        else:
            idle_forwards(model, pair_loss, pad_id, info.device, split)
    model.train(was_training)
    metrics = averaged(sums, totals, info.device)
    (loss_sum,) = all_reduce_sums([loss], info.device)
    return {"eval_loss": loss_sum, **{f"eval_{k}": v for k, v in metrics.items()}}
