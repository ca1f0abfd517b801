"""One training step's device memory, measured by torch's FSDP2 memory tracker while the step really runs.

The step is training's own code: the recipe's objective's micro-step with its `ForwardLoss` (chunked or full
loss, activation offload), gradient sync only on the last micro-batch, then the optimizer update. The planner runs
it on fake tensors (measure/fake_step.py: no weights, no GPU); measure/real_step.py runs it on a real model to hold
the planner to it. Both count with the tracker below, so a plan and a measurement differ only by what fake tensors
change.

Counted: every tensor storage alive on the compute device, op by op (parameters, gradients, optimizer state,
activations, temporaries, FSDP2's all-gather and reduce-scatter buffers), minus what lives in host memory: FSDP2's
offloaded shards, gradients and optimizer state, and activation offload's host copies. Plus one thing no tracker
sees: the scratch bitsandbytes' fused 4-bit matmul allocates inside its kernel (the dequantized weight).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import bitsandbytes as bnb
import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.fsdp import FSDPModule

from qlora_fsdp.data.batching import Batch
from qlora_fsdp.distributed.grad_sync import set_gradient_sync
from qlora_fsdp.layers.decoder import decoder_layers
from qlora_fsdp.measure.op_work import (
    GEMM_4BIT,
    TILE_WORK_BEGIN,
    TILE_WORK_END,
    Work,
    dequantized_weight,
    op_work,
)
from qlora_fsdp.objectives.base import Objective
from qlora_fsdp.optimizer import ShardedOptimizer

TOTAL = "Total"
GATHERED = frozenset({"Unsharded Param", "All Gather"})  # FSDP2's gathered layers and their all-gather buffers
GRADIENTS = frozenset({"Unsharded Grad", "Sharded Grad", "Reduce Scatter", "Gradient"})
HOST_UNDER_OFFLOAD = frozenset({"Sharded Param", "Sharded Grad", "OptState"})  # FSDP2's CPUOffloadPolicy


@dataclass(frozen=True)
class Moment:
    """Device bytes at one instant of the step, and the part of them that is gathered parameters or gradients."""

    total: int = 0
    gathered: int = 0
    gradients: int = 0


# a part of the step: (micro-batch, what runs, the decoder layer running or -1). What runs: "pre" (embeddings, the
# root's gather: before the first layer), "forward", "post" (the final norm and FSDP2's root hooks after the last
# layer, and their backward), "loss" (the output layer and the loss, forward and backward), "backward" (recompute
# included), "end" (after the layers' backward), "optimizer"
Segment = tuple[int, str, Any]
MODEL_PARTS = ("pre", "forward", "post", "backward", "end")


@dataclass(frozen=True)
class StepMemory:
    """One rank's step: the peak instant (device bytes) of each part, what the loss itself takes, what offload
    keeps on the host. Kept per part so that a long model can be measured shorter (measure/fake_step.py)."""

    segments: dict[Segment, Moment]
    loss_own: dict[int, int]  # per micro-batch: the loss's own peak (its largest rise while it runs)
    offloaded: int = 0  # peak bytes of activations waiting in host memory
    work: dict[tuple[int, str], Work] = field(default_factory=dict)  # per (micro-batch, part): what it does

    def phase(self, *parts: str) -> Moment:
        return max((m for (_, part, _), m in self.segments.items() if part in parts), key=lambda m: m.total,
                   default=Moment())

    @property
    def model(self) -> Moment:
        """The peak of forward and backward through the model (recompute included), the loss aside."""
        return self.phase(*MODEL_PARTS)

    def model_instant(self, key: Callable[[Moment], int] = lambda m: m.total) -> Segment | None:
        """The part of forward and backward where `key` (by default the device total) is largest."""
        return max((s for s in self.segments if s[1] in MODEL_PARTS), key=lambda s: key(self.segments[s]),
                   default=None)

    @property
    def activations_instant(self) -> Segment | None:
        """Where what is neither gathered parameters nor gradients (activations, temporaries) is largest."""
        return self.model_instant(lambda m: m.total - m.gathered - m.gradients)

    @property
    def loss(self) -> Moment:
        return self.phase("loss")

    @property
    def optimizer(self) -> Moment:
        return self.phase("optimizer")

    @property
    def peak(self) -> int:
        return max(self.model.total, self.loss.total, self.optimizer.total)

    @property
    def own_loss_bytes(self) -> int:
        """Logits, loss and their gradients: the loss's own peak."""
        return max(self.loss_own.values(), default=0)


def kind(key: object) -> str:
    # the tracker's categories are str enums whose hash is their name's, so dict lookups by value do not work
    return str(getattr(key, "value", key))


class _PhasePeaks:
    """Mixed into torch's trackers: after every op, the device total (less host-resident kinds and bytes) is kept
    per segment of the step at its largest. Replaces the trackers' per-module bookkeeping, which costs a scan of
    every module per op (a quarter of a 70B plan's time) and which the plan does not use."""

    _curr_mem_snap: dict[torch.device, dict[Any, int]]
    _ref_class: Any
    _in_opt: bool
    _mod_tracker: Any

    def _setup(self, model: nn.Module, device: torch.device, host_kinds: Iterable[str],
               host_bytes: Callable[[], int], host_device: torch.device | None) -> None:
        self.device, self.host_device, self.host_bytes = device, host_device, host_bytes
        # the snapshot's keys are the tracker's enum members (looked up per op: resolved once here)
        members = {kind(member): member for member in self._ref_class}
        self.host_keys = [members[k] for k in host_kinds if k in members]
        self.gathered_keys = [members[k] for k in GATHERED if k in members]
        self.gradient_keys = [members[k] for k in GRADIENTS - set(host_kinds) if k in members]
        # the ModTracker names modules by their path under the root's class name
        index = {id(layer): i for i, layer in enumerate(layer_units(model))}
        root = type(model).__name__
        self.layer_index = {}
        for name, module in model.named_modules():
            inner = getattr(module, "_checkpoint_wrapped_module", module)  # a wrapper and its layer: one layer
            if id(module) in index or id(inner) in index:
                self.layer_index[f"{root}.{name}"] = index.get(id(module), index.get(id(inner), -1))
        head = getattr(model, "get_output_embeddings", lambda: None)()
        self.head_names = {f"{root}.{name}" for name, module in model.named_modules() if module is head}
        self.segments: dict[Segment, Moment] = {}
        self.loss_own: dict[int, int] = {}
        self.offloaded = self.scratch = 0
        self.offload = bool(host_kinds)
        self.work: dict[tuple[int, str], Work] = {}
        self.layers_seen: set[Segment] = set()
        # the 4-bit weights each part has dequantized so far, by id, held weakly: a freed gathered weight's id may
        # come again for another weight
        self.dequantized: dict[tuple[int, str], dict[int, weakref.ref[torch.Tensor]]] = {}
        self.tile_marks: list[Work] = []  # the work when the tiles a fake step runs began (innermost last)
        self.unpadded = False  # the micro-batch running has no padding (its attention mask is the causal one)
        self.new_micro_batch(0)

    def new_micro_batch(self, index: int) -> None:
        """Micro-batch `index` starts (the optimizer update counts as the one after the last)."""
        self.micro_batch = index
        self.new_forward()

    def new_forward(self) -> None:
        """A forward starts within the micro-batch (DPO's policy one after its reference one): the parts before the
        layers and the loss's own bytes are this forward's, not measured against the reference's low floor."""
        self.layers_ran = self.backward_reached = False
        self.loss_floor = 2**63

    def segment(self) -> Segment:
        if self._in_opt:
            return self.micro_batch, "optimizer", -1
        parents = self._mod_tracker.parents
        # in backward, the layer whose gradients are being computed is the latest (highest) one still active
        active = [self.layer_index[name] for name in parents if name in self.layer_index]
        if active:
            backward = self._mod_tracker.is_bw
            self.backward_reached |= backward
            self.layers_ran |= not backward
            return self.micro_batch, "backward" if backward else "forward", max(active)
        if not self.layers_ran:
            return self.micro_batch, "pre", -1
        if self.backward_reached:
            return self.micro_batch, "end", -1
        if parents & self.head_names or parents <= {"Global"}:  # the output layer, or no module: the loss
            return self.micro_batch, "loss", -1
        return self.micro_batch, "post", -1

    def now(self) -> Moment:
        snap = self._curr_mem_snap.get(self.device, {})
        host = sum(snap.get(k, 0) for k in self.host_keys) + self.host_bytes()
        return Moment(snap.get(TOTAL, 0) - host + self.scratch, sum(snap.get(k, 0) for k in self.gathered_keys),
                      sum(snap.get(k, 0) for k in self.gradient_keys))

    def _update_peak_stats(self, peak_state: object) -> None:
        moment, segment = self.now(), self.segment()
        if moment.total > self.segments.get(segment, Moment(-1)).total:
            self.segments[segment] = moment
        if segment[1] == "loss":  # the loss's own bytes: its largest rise above the least alive while it ran
            self.loss_floor = min(self.loss_floor, moment.total)
            own = moment.total - self.loss_floor
            self.loss_own[self.micro_batch] = max(self.loss_own.get(self.micro_batch, 0), own)
        if self.host_device is not None:
            host = self._curr_mem_snap.get(self.host_device, {})
            self.offloaded = max(self.offloaded, next((v for k, v in host.items() if kind(k) == TOTAL), 0))

    def dispatch_with_scratch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
                              call: Callable[[], Any]) -> Any:
        """bitsandbytes' 4-bit matmul dequantizes the whole weight into a buffer inside its kernel (CUDA's
        unfused path for more than 1,536 tokens, the CPU kernel always): invisible to a dispatch-level tracker,
        so it is counted for the op's duration, next to the op's output. Each op's work is added to its part's."""
        self.scratch = fused_matmul_scratch(func, args, self.device)
        try:
            out = call()
        finally:
            self.scratch = 0
        self.count_work(func, args, kwargs or {}, out)
        return out

    def count_work(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        micro, part, layer = self.segment()
        work = self.work.setdefault((micro, part), Work())
        if func is TILE_WORK_BEGIN:
            self.tile_marks.append(work.copy())
            return
        if func is TILE_WORK_END:
            work.repeat_since(self.tile_marks.pop(), args[1])
            return
        done = op_work(func, args, kwargs, out, part, self.offload, self.host_device, self.unpadded)
        weight = dequantized_weight(func, args)
        seen = self.dequantized.setdefault((micro, part), {})
        if weight is not None and (id(weight) not in seen or seen[id(weight)]() is not weight):
            seen[id(weight)] = weakref.ref(weight)
            done.distinct_dequant_elements = done.dequant_elements
        work.add(done)
        if layer >= 0 and (micro, part, layer) not in self.layers_seen:
            self.layers_seen.add((micro, part, layer))
            work.layers += 1


def layer_units(model: nn.Module) -> list[nn.Module]:
    """The decoder layers in order, as the modules whose forward runs them: FSDP2's units below the root (a layer
    or the checkpoint wrapper around it), else the layers themselves."""
    if isinstance(model, FSDPModule):
        return [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    return decoder_layers(model)


def fused_matmul_scratch(func: Any, args: tuple[Any, ...], device: torch.device) -> int:
    if func is not GEMM_4BIT or args[0].device != device:
        return 0
    a, shape, absmax_8bit = args[0], args[2], args[7] if len(args) > 7 else None
    weight = shape[0] * shape[1] * a.element_size()
    # nested quantization: the 8-bit absmax is decoded to fp32, then shifted by the offset (two fp32 copies)
    return weight + (2 * 4 * absmax_8bit.numel() if absmax_8bit is not None else 0)


class FSDPStepTracker(_PhasePeaks, FSDPMemTracker):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.dispatch_with_scratch(func, args, kwargs, lambda: super(FSDPStepTracker, self).__torch_dispatch__(
            func, types, args, kwargs))


class StepTracker(_PhasePeaks, MemTracker):
    """For a model FSDP2 does not wrap (one process, no offload, no mixed-precision policy)."""

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # torch's tracker hooks every parameter's gradient and fails on a frozen one: hook the trainable ones only
        sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        for param in module.parameters() if install_grad_hooks else ():
            if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                def track(grad: torch.Tensor) -> None:
                    self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(track), param.register_post_accumulate_grad_hook(lambda p: track(p.grad)))
        return sizes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.dispatch_with_scratch(func, args, kwargs, lambda: super(StepTracker, self).__torch_dispatch__(
            func, types, args, kwargs))


def stored_quant_state(state: Any) -> list[torch.Tensor]:
    """A Linear4bit's quantization state as stored: absmax (uint8 with double quantization) and the 4-bit
    codebook, plus, when nested, the second level's fp32 absmax, its codebook and the offset."""
    tensors = [state.absmax, state.code]
    if getattr(state, "state2", None) is not None:
        tensors += [state.state2.absmax, state.state2.code, state.offset]
    return tensors


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every Linear4bit's quantization state (whole on every rank; neither a parameter nor a buffer)."""
    return [tensor for module in model.modules() if isinstance(module, bnb.nn.Linear4bit)
            and getattr(module, "quant_state", None) is not None for tensor in stored_quant_state(module.quant_state)]


def batch_tensors(batch: Batch) -> list[torch.Tensor]:
    return [t for t in (batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids) if t is not None]


def make_tracker(model: nn.Module, optimizer: ShardedOptimizer, device: torch.device, host_kinds: Iterable[str],
                 host_bytes: Callable[[], int], host_device: torch.device | None) -> FSDPStepTracker | StepTracker:
    tracker: FSDPStepTracker | StepTracker
    if isinstance(model, FSDPModule):
        tracker = FSDPStepTracker(model, optimizer.inner)
    else:
        tracker = StepTracker()
        tracker.track_external(model, optimizer.inner)
    tracker._setup(model, device, host_kinds, host_bytes, host_device)
    return tracker


def track_existing(tracker: FSDPStepTracker | StepTracker, tensors: Iterable[torch.Tensor]) -> None:
    """Tensors made before the tracker started and alive throughout (quantization state, the batches): the
    trackers only learn of parameters, buffers and optimizer state by themselves."""
    category = tracker._ref_class.__members__["BUFFER"]
    for tensor in tensors:
        tracker._update_and_maybe_create_winfos(tensor, category)


def run_step(model: nn.Module, optimizer: ShardedOptimizer, micro_batches: list[Batch], device: torch.device,
             objective: Objective, offload_to_host: bool, host_bytes: Callable[[], int] = lambda: 0,
             host_device: torch.device | None = None) -> StepMemory:
    """Training's step (the objective's micro-step on each micro-batch, gradients synced on the last, then the
    update) under the tracker.

    Not run: the gradient clip (per-parameter norms, scalars) and the loss bookkeeping (`.item()`, all-reduces of
    counts): they read values, which fake tensors do not have. `objective`: the recipe's (DPO's reference forward
    runs where the batches carry no reference log-probabilities).
    `offload_to_host`: FSDP2's shards, gradients and optimizer state are host memory (fsdp.cpu_offload);
    `host_bytes` says how many bytes of what the tracker sees on `device` are really host copies now (activation
    offload on a CPU mesh); `host_device` is where the planner sends activation offload's copies instead."""
    tracker = make_tracker(model, optimizer, device, HOST_UNDER_OFFLOAD if offload_to_host else (), host_bytes,
                           host_device)
    track_existing(tracker, quant_state_tensors(model) + [t for b in micro_batches for t in batch_tensors(b)])
    def another_forward_next() -> None:
        tracker.reset_mod_stats()
        tracker.new_forward()

    objective.watch_forwards(another_forward_next)
    with tracker:
        for index, batch in enumerate(micro_batches):
            tracker.reset_mod_stats()  # the tracker refuses a second forward of the root without this
            tracker.new_micro_batch(index)
            tracker.unpadded = batch.segments is None and batch.n_tokens == batch.input_ids.numel()
            set_gradient_sync(model, index == len(micro_batches) - 1)
            objective.planned_micro_step(model, batch, device)
        tracker.new_micro_batch(len(micro_batches))
        optimizer.step()
        optimizer.zero_grad()
    return StepMemory(tracker.segments, tracker.loss_own, tracker.offloaded, tracker.work)
