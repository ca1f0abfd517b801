"""The recipe's training step run on fake tensors: measured memory without weights, a GPU or a real process group.

The model is built and sharded exactly as training builds it (meta device, NF4 swap, LoRA, checkpointing,
`fully_shard` over a fake process group of the recipe's world size), then allocated under FakeTensorMode: every
tensor has its shape, dtype and device but no data, and every op (bitsandbytes' 4-bit and 8-bit kernels included:
bitsandbytes registers fake kernels) computes only the shapes of its outputs. Each Linear4bit gets a quantization
state of the real shapes. Then step_tracker.run_step runs training's own step under torch's FSDP2 memory tracker.

The fake device is the CPU (CUDA streams cannot exist in a CPU-only torch): FSDP2's offloaded shards then sit on
the same device as the compute, and the tracker's categories (sharded parameters, gradients, optimizer state) tell
them apart; activation offload's host copies go to the meta device instead.

A long model is measured shorter: a fake op costs about as much as a real op's Python overhead, so the 80 layers
of a 70B would take minutes. Decoder layers are identical in shape, so the layers are split into a head, a block
repeated k times and a tail (`Repeats`); the step is measured with the block repeated 4 and 5 times, and the peak
of every part of the step (a layer's forward or backward, the loss, the update) is continued along its line to k
repeats. tests/test_step_memory.py holds that equal to the whole model's run, part by part.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import torch
from accelerate import init_empty_weights
from peft.tuners.lora import dora
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoModelForCausalLM, PretrainedConfig

from qlora_fsdp.config import CheckpointedLayers, Config
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.layers.activation_offload import ActivationOffloader
from qlora_fsdp.layers.decoder import decoder_layers
from qlora_fsdp.layers.experts4bit import shaped_quant_state
from qlora_fsdp.loading.export_target import train_through_export
from qlora_fsdp.loading.fill import materialize
from qlora_fsdp.loading.sharding import sharded_meta_model
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.measure.fake_experts import plan_experts
from qlora_fsdp.measure.step_tracker import Moment, Segment, StepMemory, run_step
from qlora_fsdp.objectives.base import Objective
from qlora_fsdp.objectives.table import build_objective
from qlora_fsdp.optimizer import build_optimizer

DEVICE = torch.device("cpu")
HOST_STAND_IN = torch.device("meta")  # activation offload's host copies: counted apart, never on the device
WHOLE_MODEL_LAYERS = 12  # up to this many decoder layers, the whole model runs (about 0.3 s a layer and micro-batch)
# a layer's step depends on its neighbours: FSDP2 gathers the next layer while one computes and reduce-scatters the
# previous one's gradients, so the first and last repeat of a block differ from the middle ones; activation offload
# also copies back the layer after next, so there the first and last two do. A long model runs with its block
# repeated 2 * edge and 2 * edge + 1 times, where the one more is a middle repeat (see `edge_repeats`)
EDGE, OFFLOAD_EDGE = 1, 2
# layer types that differ only in which keys a query attends to (sliding windows): the same tensors, the same bytes
ATTENTION_SPANS = {"sliding_attention", "full_attention", None}


def fake_quant_state(linear: bnb.nn.Linear4bit, cfg: Config) -> bnbf.QuantState:
    quant = cfg.quant
    return shaped_quant_state((linear.out_features, linear.in_features), quant.blocksize, quant.double_quant,
                              quant.quant_type, TORCH_DTYPES[cfg.model.dtype])


def attach_quant_state(module: bnb.nn.Linear4bit, args: tuple[object, ...]) -> None:
    """What bitsandbytes' own forward does when FSDP2 hands a Linear4bit a plain gathered weight (it re-wraps the
    weight as Params4bit, which a fake tensor cannot be): the weight carries the module's quantization state."""
    weight: Any = module.weight  # a gathered plain tensor here, given the attribute bitsandbytes reads
    if getattr(weight, "quant_state", None) is None:
        weight.quant_state = module.quant_state


@contextmanager
def dora_dequantizes_fake_weights() -> Iterator[None]:
    """DoRA's weight norm asks PEFT for the dequantized base weight, which PEFT makes of a Params4bit alone; the run's
    gathered weight is one (bitsandbytes re-wraps it), a fake one cannot be: dequantized here as PEFT would."""
    peft_dequantize = dora.dequantize_module_weight

    def dequantized(module: nn.Module) -> Any:  # PEFT's says Parameter; its dequantized ones are plain tensors
        state = getattr(module.weight, "quant_state", None)
        if isinstance(module, bnb.nn.Linear4bit) and state is not None:
            return bnbf.dequantize_4bit(module.weight, state)
        return peft_dequantize(module)

    dora.dequantize_module_weight = dequantized
    try:
        yield
    finally:
        dora.dequantize_module_weight = peft_dequantize


def give_quant_states(model: nn.Module, cfg: Config) -> None:
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.quant_state = fake_quant_state(module, cfg)
            module.register_forward_pre_hook(attach_quant_state)


def planned_objective(cfg: Config, forward_loss: ForwardLoss | None = None) -> Objective:
    """The recipe's objective as training builds it, over `forward_loss` (a plan's questions need none)."""
    return build_objective(cfg, forward_loss or ForwardLoss())


def first_micro_batch_weight(accumulation: int) -> int:
    """How many micro-batches of a step the first measured one stands for in the plan's time (every one but the
    last, which syncs the gradients and is measured as the second)."""
    return accumulation - 1 if min(accumulation, Objective.PLANNED_MICRO_BATCHES) > 1 else 1


def update_rows(cfg: Config) -> int:
    """Rows of a micro-batch's forward (GRPO's: num_generations completions of each of its prompts)."""
    return planned_objective(cfg).planned_rows()


def planned_flops_per_token(cfg: Config) -> int:
    """6N a token (forward, its recompute, input gradients), 2N more for each forward without gradients the
    objective adds (DPO's reference), as training counts them."""
    return 6 + 2 * planned_objective(cfg).planned_extra_forwards()


def planning_forward_loss(cfg: Config) -> ForwardLoss:
    """Training's forward and loss for this recipe, with activation offload's host copies sent to the stand-in."""
    forward_loss = ForwardLoss.for_config(cfg, DEVICE)
    if forward_loss.offloader is None:
        return forward_loss
    return dataclasses.replace(forward_loss, offloader=ActivationOffloader(DEVICE, host_device=HOST_STAND_IN))


def measure_fake_step(cfg: Config, hf_config: PretrainedConfig, mesh: DeviceMesh) -> StepMemory:
    """The step of `cfg` on fake tensors, whole model.

    Micro-batches: one when the recipe accumulates none, else two (sync off, then on). The middle micro-batches
    of a longer accumulation find the same tensors alive as the last (FSDP2 accumulates into the unsharded
    gradients the first one allocated) and reduce-scatter nothing, so they reach no higher (tested)."""
    model = sharded_meta_model(cfg, hf_config, mesh)
    with FakeTensorMode(allow_non_fake_inputs=True):  # meta and real inputs become fake
        materialize(model, DEVICE, DEVICE)
        give_quant_states(model, cfg)
        # export.target: the rounding's ops and saved weights, as the run has them
        train_through_export(model, cfg, first_micro_batch_weight(cfg.data.grad_accum_steps),
                             fused=cfg.export.rounding_kernel != "torch")  # as on the GPU the plan is for
        plan_experts(model)  # routing has no values here: every expert takes its share
        # real: bitsandbytes builds its 8-bit code tables from Python numbers, collate counts the targets
        objective = planned_objective(cfg, planning_forward_loss(cfg))
        with unset_fake_temporarily():
            optimizer = build_optimizer(model, cfg.optim, cfg.lora)
            batches = objective.planned_batches()
        optimizer.materialize_state()  # as from the 2nd step on: the state exists before the step starts
        with dora_dequantizes_fake_weights():
            return run_step(model, optimizer, batches, DEVICE, objective, offload_to_host=cfg.fsdp.cpu_offload,
                            host_device=HOST_STAND_IN)


# ---- a long model, measured shorter ---------------------------------------------------------------------------

# a decoder layer as the step sees it: checkpointed or not, its layer type, and which of the model's layer shapes it
# has (GLM-4.5's and DeepSeek-V3's dense first layers, Maverick's dense layers between MoE ones)
Kind = tuple[bool, object, int]


@dataclass(frozen=True)
class Repeats:
    """Decoder layers as head + block * count + tail."""

    head: tuple[Kind, ...]
    block: tuple[Kind, ...]
    count: int
    tail: tuple[Kind, ...]
    edge: int = EDGE  # repeats at each end whose step differs from a middle repeat's

    def layers(self, count: int) -> tuple[Kind, ...]:
        return self.head + self.block * count + self.tail

    @property
    def short_counts(self) -> tuple[int, int]:
        """The block's repeats in the two shortened runs: every edge repeat, then one middle repeat more."""
        return 2 * self.edge, 2 * self.edge + 1

    @property
    def saved(self) -> int:
        """Layers the shortened runs leave out (the longer one repeats the block short_counts[1] times)."""
        return (self.count - self.short_counts[1]) * len(self.block)


def edge_repeats(cfg: Config) -> int:
    """How many repeats at each end of a block differ from the middle ones (measured: with one edge repeat, a
    step with activation offload differs from the whole model's; every shipped recipe without it plans the same)."""
    return OFFLOAD_EDGE if cfg.activation_checkpointing.offload else EDGE


def layer_kinds(cfg: Config, hf_config: PretrainedConfig) -> tuple[Kind, ...]:
    """Per decoder layer: whether it is checkpointed, and its type where the architecture mixes types (sliding
    window and full attention layers)."""
    n = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None) or [None] * n
    if set(types) <= ATTENTION_SPANS:  # a window changes which scores count, not what a layer holds: one kind
        types = [None] * n
    shapes = layer_shapes(hf_config, cfg.model.trust_remote_code)
    return tuple((cfg.activation_checkpointing.wraps(index, n), types[index], shapes[index]) for index in range(n))


def layer_shapes(hf_config: PretrainedConfig, trust_remote_code: bool) -> tuple[int, ...]:
    """Per decoder layer, which of the distinct parameter layouts it has (numbered in order of first appearance),
    read off the model built on the meta device (a tenth of a second for a 100B: only a step measured anew asks):
    the layer types do not say where a family puts its dense layers among the MoE ones."""
    with init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    layers = text_decoder_layers(model, hf_config.num_hidden_layers)
    layouts = [tuple((name, tuple(param.shape)) for name, param in layer.named_parameters()) for layer in layers]
    numbered = {layout: index for index, layout in enumerate(dict.fromkeys(layouts))}
    return tuple(numbered[layout] for layout in layouts)


def text_decoder_layers(model: nn.Module, n: int) -> list[nn.Module]:
    """The n decoder layers of the text model (a multimodal model's vision tower has layers of its own)."""
    layers = decoder_layers(model)
    by_class: dict[type, list[nn.Module]] = {}
    for layer in layers:
        by_class.setdefault(type(layer), []).append(layer)
    return next((found for found in by_class.values() if len(found) == n), layers[:n])


def find_repeats(kinds: tuple[Kind, ...], max_block: int = 8, edge: int = EDGE) -> Repeats:
    """The split that leaves out the most layers (a block of up to `max_block` layers repeated in a row)."""
    best = Repeats(kinds, (), 0, (), edge)
    for size in range(1, max_block + 1):
        for start in range(len(kinds) - 2 * size + 1):
            block = kinds[start : start + size]
            count = 1
            while kinds[start + count * size : start + (count + 1) * size] == block:
                count += 1
            found = Repeats(kinds[:start], block, count, kinds[start + count * size :], edge)
            if found.saved > best.saved:
                best = found
    return best


def neighbours_counted(repeats: Repeats) -> Repeats:
    """One edge repeat more where the block meets a layer of other shapes (a dense first layer): the edge repeat
    next to it prefetches or reduce-scatters that layer's bytes, not a repeat's, so it no longer stands for a middle
    one (measured: a middle repeat's backward held the step's peak, above both edges')."""
    def shape(kinds: tuple[Kind, ...], at: int) -> int:
        return kinds[at][2]

    if not repeats.block:  # nothing repeats: the whole model runs
        return repeats
    head_differs = bool(repeats.head) and shape(repeats.head, -1) != shape(repeats.block, 0)
    tail_differs = bool(repeats.tail) and shape(repeats.tail, 0) != shape(repeats.block, -1)
    return dataclasses.replace(repeats, edge=repeats.edge + 1) if head_differs or tail_differs else repeats


def shortened(cfg: Config, hf_config: PretrainedConfig, kinds: tuple[Kind, ...]) -> tuple[Config, PretrainedConfig]:
    """The recipe and architecture with exactly these layers, in this order."""
    short_hf = copy.deepcopy(hf_config)
    short_hf.num_hidden_layers = len(kinds)
    if getattr(hf_config, "layer_types", None):  # attention spans alone were one kind: all full attention
        short_hf.layer_types = [layer_type or "full_attention" for _, layer_type, _ in kinds]
    wrapped = [index for index, (checkpointed, *_) in enumerate(kinds) if checkpointed]
    mode: CheckpointedLayers = "every_layer" if len(wrapped) == len(kinds) else "layers" if wrapped else "off"
    policy = dataclasses.replace(cfg.activation_checkpointing, mode=mode, layers=wrapped)
    return dataclasses.replace(cfg, activation_checkpointing=policy), short_hf


def position(layer: int, repeats: Repeats) -> object | None:
    """Where a layer sits in the split: the same label in the shortened runs and in the whole model; None for the
    block's middle repeats, which never hold a peak of their own (see extrapolated). -1 (no layer) stays."""
    head, size = len(repeats.head), len(repeats.block)
    if layer < head:
        return layer
    if layer >= head + repeats.count * size:
        return "tail", layer - head - repeats.count * size
    instance, offset = divmod(layer - head, size)
    if instance < repeats.edge:
        return "block", "from start", instance, offset
    if instance >= repeats.count - repeats.edge:
        return "block", "from end", repeats.count - 1 - instance, offset
    return None


def relabelled(step: StepMemory, repeats: Repeats) -> dict[Segment, Moment]:
    labelled = {}
    for (micro, part, layer), moment in step.segments.items():
        where = position(layer, repeats)
        if where is not None:
            labelled[micro, part, where] = moment
    return labelled


def extrapolated(shorter: StepMemory, longer: StepMemory, repeats: Repeats) -> StepMemory:
    """The whole model's step from the runs with the block repeated `repeats.short_counts` times.

    Every part's peak is a line in the number of repeats: from the second repeat on, one more block adds the same
    bytes to every instant (its shards, its kept activations, its gradients) and changes nothing else. A middle
    repeat's peak is a line in its place between the edge repeats at either end, so one of those holds the
    block's peak; only their parts are continued, each along its own line (the largest part at 4 and 5 repeats
    need not be the largest at 80)."""
    first, second = repeats.short_counts
    a = relabelled(shorter, dataclasses.replace(repeats, count=first))
    b = relabelled(longer, dataclasses.replace(repeats, count=second))

    def line(x: int, y: int) -> int:
        return x + (y - x) * (repeats.count - first)

    segments = {segment: Moment(*(line(getattr(a[segment], f.name), getattr(b[segment], f.name))
                                  for f in dataclasses.fields(Moment))) for segment in a}
    own = {micro: line(shorter.loss_own[micro], longer.loss_own[micro]) for micro in shorter.loss_own}
    # work adds up layer by layer: each part's is a line in the repeats too
    work = {key: shorter.work[key].scaled_line(longer.work[key], repeats.count - first) for key in shorter.work}
    return StepMemory(segments, own, line(shorter.offloaded, longer.offloaded), work)


def planned_step(cfg: Config, hf_config: PretrainedConfig, mesh: DeviceMesh,
                 whole_model_layers: int = WHOLE_MODEL_LAYERS) -> StepMemory:
    """The measured step of `cfg`: the whole model when it is short, else the shortened runs continued."""
    repeats = neighbours_counted(find_repeats(layer_kinds(cfg, hf_config), edge=edge_repeats(cfg)))
    if hf_config.num_hidden_layers <= whole_model_layers or repeats.saved <= 0:
        return measure_fake_step(cfg, hf_config, mesh)
    runs = [shortened(cfg, hf_config, repeats.layers(count)) for count in repeats.short_counts]
    if not all(cuts_to(run, repeats.layers(count)) for run, count in zip(runs, repeats.short_counts, strict=True)):
        return measure_fake_step(cfg, hf_config, mesh)  # the config cannot be cut to those layers: all of them
    shorter, longer = (measure_fake_step(*run, mesh) for run in runs)
    return extrapolated(shorter, longer, repeats)


def cuts_to(run: tuple[Config, PretrainedConfig], kinds: tuple[Kind, ...]) -> bool:
    """Whether the shortened config builds those layers (Gemma 4's per-layer settings, fixed for its own layer
    types, refuse a config of other types: transformers raises ValueError)."""
    try:
        return layer_kinds(*run) == kinds
    except ValueError:
        return False
