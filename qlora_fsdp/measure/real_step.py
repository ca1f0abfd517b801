"""What a loaded model really holds, counted from its tensors: the measured side of the planner's figures.

The planner (measure.held, plan.memory) predicts bytes from shapes on the meta device; these count the real tensors, so
benchmarks/load_as_rank.py can report one rank's memory and the tests can hold the planner to it byte for byte;
`measured_step` runs the training step for real under the tracker the planner's fake step uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import bitsandbytes.functional as bnbf
import torch

from qlora_fsdp.config import Config
from qlora_fsdp.data.batching import Batch
from qlora_fsdp.distributed import DistInfo
from qlora_fsdp.layers.activation_offload import ActivationOffloader
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.measure.fake_step import planned_objective
from qlora_fsdp.measure.step_tracker import StepMemory, run_step, stored_quant_state
from qlora_fsdp.optimizer import build_optimizer
from qlora_fsdp.precision import describe_device
from qlora_fsdp.run.description import describe_run


def held_quant_state_bytes(state: bnbf.QuantState) -> int:
    """Bytes of a Linear4bit's stored quantization state; the planner's counterpart, from shapes alone, is
    measure.held.quant_state_bytes."""
    return sum(t.numel() * t.element_size() for t in stored_quant_state(state))


def measured_step(cfg: Config, info: DistInfo, batches: list[Batch] | None = None) -> StepMemory:
    """The step of `cfg` run for real on this rank (random weights from config.json do: memory does not depend on
    values), counted by the tracker the planner counts with: its figures are the plan's to match. The batches
    default to the planner's own (full rows of the recipe's shape)."""
    cfg = describe_run(cfg, describe_device(info.device)).cfg
    model = build_sharded_model(cfg, info)
    optimizer = build_optimizer(model, cfg.optim, cfg.lora)
    optimizer.materialize_state()  # the state exists from the first step on, as in the plan
    forward_loss = ForwardLoss.for_config(cfg, info.device)
    offloader = forward_loss.offloader
    host_bytes = host_copy_bytes(offloader) if offloader is not None and offloader.host_device == info.device \
        else (lambda: 0)
    objective = planned_objective(cfg, forward_loss)
    return run_step(model, optimizer, batches or objective.planned_batches(), info.device, objective,
                    offload_to_host=cfg.fsdp.cpu_offload, host_bytes=host_bytes)


def host_copy_bytes(offloader: ActivationOffloader) -> Callable[[], int]:
    """Bytes of activation offload's host copies alive now, for a CPU mesh, where they sit on the very device
    the tracker counts. Its counters take a copy only once made, so the copy being made is added: its buffer
    exists, and the tracker sees it, from the allocation on."""
    in_progress = [0]
    offload = offloader._offload

    def counted_offload(tensor: torch.Tensor) -> Any:
        in_progress[0] = tensor.numel() * tensor.element_size()
        try:
            return offload(tensor)
        finally:
            in_progress[0] = 0

    offloader._offload = counted_offload  # type: ignore[method-assign]
    return lambda: offloader.stats.host_bytes + in_progress[0]
