"""How long a step takes on the recipe's GPUs, priced from the work the planner's fake step counted (plan/op_work.py).

Each part of a micro-batch (the layers' forward, their backward with its recompute, the loss, the update) costs:
- compute: each matmul on the roofline (its FLOPs at the GPU's dense peak times MATMUL_EFFICIENCY, or its bytes at
  the memory bandwidth times MEMORY_EFFICIENCY, whichever takes longer), attention's FLOPs at that peak,
  element-wise traffic and the 4-bit dequantization at that bandwidth;
- link: the bytes FSDP2's all-gathers and reduce-scatters send and receive, and the host<->GPU copies of offload.
  On a board with NVLink the collectives use it and the copies use PCIe; otherwise everything crosses the card's
  PCIe link, each direction carrying its own bytes (GeForce cards without peer-to-peer go through host memory:
  the same bytes on the same link).
FSDP2 gathers the next layer while this one computes and reduce-scatters the previous one's gradients meanwhile, so
over n layers a part takes max(compute, link) plus one layer of the smaller (the first gather, or the last
reduce-scatter, has nothing to hide behind). The loss and the update do not overlap with transfers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from qlora_fsdp.measure.fake_step import first_micro_batch_weight
from qlora_fsdp.measure.op_work import DEQUANT_BYTES_PER_ELEMENT, Work
from qlora_fsdp.measure.step_tracker import StepMemory
from qlora_fsdp.objectives.base import Objective
from qlora_fsdp.run.accelerators import GPU

PIPELINED_PARTS = ("forward", "backward")
# Not physical, so named (docs/benchmarks/step-time.md says where each comes from):
# the fraction of the datasheet's dense bf16 peak that the step's matmuls and attention reach. It differs by card
# (sustained clocks under the power limit: a 4090 boosts past its rated clock, a 300 W RTX 6000 Ada stays far
# below it), so it is fitted per GPU on the `fit` half of the published runs (benchmarks/data/published_runs.json)
# and judged on the other half; a GPU without published runs takes the fit over all of them
MATMUL_EFFICIENCY = 0.76
GPU_MATMUL_EFFICIENCY = {"rtx3090": 0.76, "rtx4090": 0.995, "rtxa5000": 0.5, "rtx6000ada": 0.265,
                         "a100-40gb": 0.77, "h100": 0.435}
# streaming kernels reach about 80% of DRAM bandwidth (read/write turnarounds, refresh)
MEMORY_EFFICIENCY = 0.8
# a PCIe link carries 256-byte payloads in TLPs of about 280 bytes (0.91), less flow-control and acknowledgement
# packets and DMA read-request round trips: about 0.8 of the signalling rate reaches the copy
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Rates:
    """What one GPU and its links do per second."""

    flops: float
    memory: float
    pcie: float  # each way
    nvlink: float  # each way; 0 without
    host_memory: float

    @classmethod
    def of(cls, gpu: GPU, matmul_efficiency: float = MATMUL_EFFICIENCY, host_memory_gbps: float = 20.0) -> Rates:
        return cls(gpu.bf16_tflops * 1e12 * matmul_efficiency, gpu.memory_gbps * 1e9 * MEMORY_EFFICIENCY,
                   gpu.pcie_gbps * 1e9 * LINK_EFFICIENCY, gpu.nvlink_gbps * 1e9 * LINK_EFFICIENCY,
                   host_memory_gbps * 1e9)


@dataclass
class StepTime:
    """Seconds of one optimizer step on one rank, by kind of work; `exposed` is what transfers add after overlap."""

    matmul: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    dequant: float = 0.0
    collectives: float = 0.0  # on their own, before overlap
    copies: float = 0.0  # host<->GPU, on their own, before overlap
    optimizer: float = 0.0
    exposed: float = 0.0
    generation: float = 0.0  # GRPO: the policy's completions, and the log-probabilities kept from generation
    vision: float = 0.0  # a vision-language recipe: its images through the vision tower (measure/image_side.py)
    total: float = 0.0

    @property
    def compute(self) -> float:
        return self.matmul + self.attention + self.elementwise + self.dequant

    def add(self, other: StepTime, times: float) -> None:
        for field in fields(self):
            setattr(self, field.name, getattr(self, field.name) + times * getattr(other, field.name))


def link_seconds(work: Work, rates: Rates) -> tuple[float, float, float]:
    """(collectives alone, copies alone, both as they share the links)."""
    collective = work.gather_bytes + work.scatter_bytes
    copies = max(work.to_gpu_bytes, work.to_host_bytes) / rates.pcie
    if rates.nvlink:
        alone = collective / rates.nvlink
        return alone, copies, max(alone, copies)
    inbound, outbound = collective + work.to_gpu_bytes, collective + work.to_host_bytes
    return collective / rates.pcie, copies, max(inbound, outbound) / rates.pcie


def part_time(part: str, work: Work, rates: Rates, offload: bool) -> StepTime:
    matmuls = sum(count * max(flops / rates.flops, traffic / rates.memory)
                  for (flops, traffic), count in work.matmuls.items())
    time = StepTime(matmul=matmuls, attention=work.attention_flops / rates.flops,
                    elementwise=work.memory_bytes / rates.memory,
                    dequant=work.dequant_elements * DEQUANT_BYTES_PER_ELEMENT / rates.memory,
                    optimizer=work.optimizer_bytes / (rates.host_memory if offload else rates.memory))
    time.collectives, time.copies, link = link_seconds(work, rates)
    busy = time.compute + time.optimizer
    if part in PIPELINED_PARTS and work.layers >= 1:
        time.total = max(busy, link) + min(busy, link) / work.layers
    else:
        time.total = busy + link
    # context parallel's all-to-alls: attention needs their output at once, so nothing overlaps them
    trades = work.trade_bytes / (rates.nvlink or rates.pcie)
    time.collectives += trades
    time.total += trades
    time.exposed = time.total - busy
    return time


def matmul_efficiency(gpu_name: str) -> float:
    return GPU_MATMUL_EFFICIENCY.get(gpu_name, MATMUL_EFFICIENCY)


def step_time(step: StepMemory, accumulation: int, gpu: GPU, offload: bool,
              matmul_efficiency: float = MATMUL_EFFICIENCY, host_memory_gbps: float = 20.0) -> StepTime:
    """One optimizer step: the measured micro-batches (the first stands for every one but the last, which syncs
    gradients), then the update (on offloaded shards: at `host_memory_gbps`, hardware.host_memory_gbps)."""
    rates = Rates.of(gpu, matmul_efficiency, host_memory_gbps)
    measured = min(accumulation, Objective.PLANNED_MICRO_BATCHES)  # micro-batch `measured` is the update
    times = {0: first_micro_batch_weight(accumulation), 1: 1} if measured > 1 else {0: 1}
    times[measured] = 1
    total = StepTime()
    for (micro, part), work in step.work.items():
        total.add(part_time(part, work, rates, offload), times[micro])
    return total
