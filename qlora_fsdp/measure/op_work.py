"""What each op of the planner's fake step does, in the units a GPU prices: matmul and attention FLOPs, bytes read
and written by the memory-bound ops, 4-bit weights dequantized, bytes sent by collectives and copied between host
and GPU. Counted from the ops training really dispatches (their shapes), never from a closed formula of the model.

FLOPs of matmuls and attention come from torch's own formulas (torch.utils.flop_counter); the CPU's attention ops,
which the fake step dispatches where a GPU would run flash attention, are priced as flash attention is, and a causal
mask halves the work (flash attention skips the masked blocks). bitsandbytes' 4-bit matmul counts its matmul and the
dequantization of its weight (the CPU kernel fuses them; CUDA dequantizes, then multiplies: the same work).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

import qlora_fsdp.kernels.export_rounding  # noqa: F401  (registers torch.ops.qlora_fsdp.export_rounded)
import qlora_fsdp.layers.blockwise_attention  # noqa: F401  (registers torch.ops.qlora_fsdp.skipped_attention_work)
import qlora_fsdp.layers.tiled_mlp  # noqa: F401  (registers torch.ops.qlora_fsdp.tile_work_begin and _end)

aten = torch.ops.aten
GEMM_4BIT = torch.ops.bitsandbytes.gemm_4bit.default
DEQUANTIZE_4BIT = torch.ops.bitsandbytes.dequantize_4bit.default
ALL_GATHER = torch.ops.c10d._allgather_base_.default
REDUCE_SCATTER = torch.ops.c10d._reduce_scatter_base_.default
ALL_GATHER_COPY_IN = torch.ops.fsdp.all_gather_copy_in.default
SKIPPED_ATTENTION = torch.ops.qlora_fsdp.skipped_attention_work.default
TILE_WORK_BEGIN = torch.ops.qlora_fsdp.tile_work_begin.default
TILE_WORK_END = torch.ops.qlora_fsdp.tile_work_end.default
EXPORT_ROUNDED = torch.ops.qlora_fsdp.export_rounded.default  # writes its `out` without reading it
ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default  # context parallel's trades around attention
# a dequantized 4-bit weight: half a byte read and two written an element (bf16/fp16; the absmax is 1/64 of that)
DEQUANT_BYTES_PER_ELEMENT = 2.5
CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (aten._scaled_dot_product_flash_attention, 4),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
        aten._scaled_dot_product_flash_attention_backward, 7),
}
GPU_ATTENTION_CAUSAL_ARG = {  # where the GPU's attention ops carry is_causal (positional)
    aten._scaled_dot_product_flash_attention: 4, aten._scaled_dot_product_flash_attention_backward: 11,
    aten._scaled_dot_product_efficient_attention: 6, aten._scaled_dot_product_efficient_attention_backward: 11,
}
ATTENTION_PACKETS = {packet for packet in flop_registry if "attention" in str(packet)}


UNREPEATED = ("matmuls", "distinct_dequant_elements", "layers")  # fields a repeat of the same ops does not add to


@dataclass
class Work:
    """One part of a step's work on one rank."""

    matmul_flops: float = 0.0
    attention_flops: float = 0.0
    memory_bytes: float = 0.0  # read and written by element-wise and other memory-bound ops
    dequant_elements: float = 0.0  # 4-bit weight elements dequantized
    # each 4-bit weight's elements once however often the part dequantized it (tiles run a weight once a tile): what
    # a decoding step, which runs every weight once, dequantizes
    distinct_dequant_elements: float = 0.0
    gather_bytes: float = 0.0  # all-gather: received (and sent) by this rank
    scatter_bytes: float = 0.0  # reduce-scatter: sent (and received) by this rank
    trade_bytes: float = 0.0  # context parallel's all-to-alls: sent (and received) by this rank; attention waits
    to_gpu_bytes: float = 0.0  # host -> GPU: offloaded shards to gather, offloaded activations brought back
    to_host_bytes: float = 0.0  # GPU -> host: offloaded gradient shards, activations saved for backward
    optimizer_bytes: float = 0.0  # read and written by the optimizer's update
    layers: float = 0.0  # decoder-layer passes in this part (FSDP2's prefetch overlaps one layer with the next)
    # each matmul's (FLOPs, bytes read and written) -> how many: priced one by one on the roofline (a LoRA
    # projection's rank-r matmul reads a whole activation for a few FLOPs: memory-bound on every GPU)
    matmuls: dict[tuple[float, float], float] = dataclasses.field(default_factory=dict)

    def add(self, other: Work) -> None:
        for field in dataclasses.fields(self):
            if field.name != "matmuls":
                setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))
        for shape, count in other.matmuls.items():
            self.matmuls[shape] = self.matmuls.get(shape, 0.0) + count

    def copy(self) -> Work:
        return dataclasses.replace(self, matmuls=dict(self.matmuls))

    def repeat_since(self, before: Work, times: float) -> None:
        """Add what was done since `before` (a copy of this work then) `times` times more: the tiles a fake step
        skipped (layers/tiled_mlp.py). Not the distinct weights (each counted once) nor the layer passes."""
        repeated = Work(**{f.name: (getattr(self, f.name) - getattr(before, f.name)) * times
                           for f in dataclasses.fields(self) if f.name not in UNREPEATED})
        repeated.matmuls = {shape: (count - before.matmuls.get(shape, 0.0)) * times
                            for shape, count in self.matmuls.items()}
        self.add(repeated)

    def scaled_line(self, other: Work, steps: float) -> Work:
        """self + (other - self) * steps: a long model's work from two shortened runs (work adds per layer)."""
        line = Work(**{f.name: getattr(self, f.name) + (getattr(other, f.name) - getattr(self, f.name)) * steps
                       for f in dataclasses.fields(self) if f.name != "matmuls"})
        for shape in self.matmuls.keys() | other.matmuls.keys():
            ours, theirs = self.matmuls.get(shape, 0.0), other.matmuls.get(shape, 0.0)
            line.matmuls[shape] = ours + (theirs - ours) * steps
        return line


def matmul(flops: float, traffic: float, **extra: float) -> Work:
    return Work(matmul_flops=flops, matmuls={(flops, traffic): 1.0}, **extra)


def nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def attention_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
                    mask_is_causal: bool) -> float | None:
    """`mask_is_causal`: the batch has no padding, so a mask is the causal one (on a GPU, transformers then
    passes is_causal instead: it looks at the mask's values, which fake tensors do not have)."""
    packet, causal_at = CPU_ATTENTION.get(func, (func._overloadpacket, GPU_ATTENTION_CAUSAL_ARG.get(
        func._overloadpacket)))
    if packet not in ATTENTION_PACKETS:
        return None
    flops = flop_registry[packet](*args, **kwargs, out_val=out)
    causal = causal_at is not None and len(args) > causal_at and args[causal_at] is True
    return flops / 2 if causal or kwargs.get("is_causal") or mask_is_causal else flops


def moved_bytes(func: Any, args: tuple[Any, ...], out: Any, host: torch.device | None) -> tuple[int, int]:
    """(to GPU, to host) bytes of a copy between the device and activation offload's host stand-in."""
    if func not in (aten._to_copy.default, aten.copy_.default) or host is None:
        return 0, 0
    source, target = (args[0], out) if func is aten._to_copy.default else (args[1], args[0])
    if not isinstance(source, torch.Tensor) or not isinstance(target, torch.Tensor):
        return 0, 0
    if target.device == host and source.device != host:
        return 0, nbytes(target)
    if source.device == host and target.device != host:
        return nbytes(target), 0
    return 0, 0


def memory_traffic(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Bytes an op reads (its tensor inputs) and writes (its outputs and the inputs it mutates)."""
    read = sum(nbytes(t) for t in tensors((args, kwargs)))
    written = sum(nbytes(t) for t in tensors(out))
    schema_args = func._schema.arguments
    for index, value in enumerate(args[: len(schema_args)]):
        alias = schema_args[index].alias_info
        if alias is not None and alias.is_write:
            written += sum(nbytes(t) for t in tensors(value))
    return read + written


# ops that allocate, reshape or ask about tensors without reading or writing their elements
NO_TRAFFIC = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
              aten.new_empty_strided.default, aten.empty_like.default, aten._unsafe_view.default,
              aten.lift_fresh.default, aten.set_.source_Storage_storage_offset, aten.resize_.default,
              aten.record_stream.default, aten._local_scalar_dense.default}


def dequantized_weight(func: Any, args: tuple[Any, ...]) -> torch.Tensor | None:
    """The packed 4-bit weight an op dequantizes, the tensor it is a view of (bitsandbytes hands its kernels a new
    transposed view every call); None: the op dequantizes nothing."""
    packed = args[1] if func is GEMM_4BIT else args[0] if func is DEQUANTIZE_4BIT else None
    return packed if packed is None or packed._base is None else packed._base


def moves_nothing(func: Any) -> bool:
    """Views, allocations and metadata queries; other collectives (the loss's counts) are a few bytes."""
    return func.is_view or func in NO_TRAFFIC or func.namespace in ("prim", "c10d")


def op_work(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, part: str, offload: bool,
            host: torch.device | None, mask_is_causal: bool = False) -> Work:
    """The work of one dispatched op in `part` of the step; `offload`: FSDP2's shards and gradients live on the
    host (each gathered shard is first copied to the GPU, each reduced gradient shard back); `mask_is_causal`:
    the micro-batch has no padding."""
    if func is GEMM_4BIT:  # the weight is dequantized (counted apart), then read in the activations' dtype
        a, shape = args[0], args[2]
        rows, elements = a.numel() // a.shape[-1], shape[0] * shape[1]
        traffic = nbytes(a) + nbytes(out) + elements * a.element_size()
        return matmul(2.0 * rows * elements, traffic, dequant_elements=float(elements))
    if func is DEQUANTIZE_4BIT:
        return Work(dequant_elements=float(out.numel()))
    if func is ALL_GATHER:
        output, shard = args[0], args[1]
        return Work(gather_bytes=nbytes(output) - nbytes(shard), to_gpu_bytes=nbytes(shard) if offload else 0)
    if func is REDUCE_SCATTER:
        output, full = args[0], args[1]
        return Work(scatter_bytes=nbytes(full) - nbytes(output), to_host_bytes=nbytes(output) if offload else 0)
    if func is ALL_TO_ALL:  # the part a rank keeps of its own tensor never crosses a link
        ranks = dist.distributed_c10d._resolve_process_group(args[3]).size()
        return Work(trade_bytes=nbytes(args[0]) * (ranks - 1) / ranks)
    if func is SKIPPED_ATTENTION:  # the blockwise kernel's pairs the fake step did not run (layers/blockwise_...)
        query, scores, flops_a_score = args[:3]
        return Work(attention_flops=float(query.numel() // query.shape[-1] // query.shape[-2] * scores
                                          * flops_a_score))
    if func._overloadpacket in flop_registry and "attention" not in str(func._overloadpacket):
        flops = float(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
        return matmul(flops, memory_traffic(func, args, kwargs, out))
    attention = attention_flops(func, args, kwargs, out, mask_is_causal)
    if attention is not None:
        return Work(attention_flops=attention)
    to_gpu, to_host = moved_bytes(func, args, out, host)
    if to_gpu or to_host:
        return Work(to_gpu_bytes=to_gpu, to_host_bytes=to_host)
    if moves_nothing(func):
        return Work()
    if func is ALL_GATHER_COPY_IN:  # reads the shards, writes them into the flat input; the output is allocated
        traffic = 2 * sum(nbytes(t) for t in tensors(args[0]))
    elif func is EXPORT_ROUNDED:
        traffic = memory_traffic(func, args, kwargs, out) - nbytes(args[0])
    else:
        traffic = memory_traffic(func, args, kwargs, out)
    return Work(optimizer_bytes=traffic) if part == "optimizer" else Work(memory_bytes=traffic)
