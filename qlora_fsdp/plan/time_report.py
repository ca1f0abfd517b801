"""The `--plan` lines on time: the step's split, tokens/s, MFU and the run's hours, on the recipe's GPUs."""

from __future__ import annotations

import math
from pathlib import Path

from qlora_fsdp.config import Config
from qlora_fsdp.measure.fake_step import planned_flops_per_token, update_rows
from qlora_fsdp.measure.held import Held
from qlora_fsdp.measure.image_side import image_side
from qlora_fsdp.measure.planning import Planning
from qlora_fsdp.measure.step_tracker import StepMemory
from qlora_fsdp.plan.generation import GenerationTime, generation_memory, generation_time, planned_generation
from qlora_fsdp.plan.memory import gpu_spec
from qlora_fsdp.plan.step_time import Rates, StepTime, matmul_efficiency, part_time, step_time
from qlora_fsdp.run.accelerators import GPU
from qlora_fsdp.run.batch_size import row_takers


def recipe_time(planning: Planning, cfg: Config, step: StepMemory) -> StepTime:
    """The step's time on the recipe's GPUs; GRPO's includes generating (plan/generation.py)."""
    time = step_time(step, cfg.data.grad_accum_steps, gpu_spec(cfg), cfg.fsdp.cpu_offload,
                     matmul_efficiency(cfg.hardware.gpu), cfg.hardware.host_memory_gbps)
    made = planned_generation(cfg)
    if made is not None:  # one generation serves `steps_served` steps
        time.generation = ((recipe_generation(planning, cfg, step).total + kept_logps_seconds(cfg, step))
                           / made.steps_served)
        time.total += time.generation
    side = image_side(planning, cfg)
    if side is not None:  # every forward's images, before its decoder forward
        time.vision = images_a_step(cfg) * side.forward_flops / max(side.images, 1) / rates(cfg).flops
        time.total += time.vision
    return time


def images_a_step(cfg: Config) -> float:
    """Images through the tower in a step: each micro-batch's forward; generated completions each carry their
    prompt's images, through generation's prompt forward and the kept log-probabilities' forwards too (once a
    generation)."""
    update: float = update_rows(cfg) * cfg.data.grad_accum_steps
    made = planned_generation(cfg)
    forwards = update
    if made is not None:
        forwards += (made.completions + made.kept_forwards * update) / made.steps_served
    return forwards * cfg.data.images_per_row


def rates(cfg: Config) -> Rates:
    return Rates.of(gpu_spec(cfg), matmul_efficiency(cfg.hardware.gpu), cfg.hardware.host_memory_gbps)


def recipe_generation(planning: Planning, cfg: Config, step: StepMemory) -> GenerationTime:
    """In the planned layout (plan/report.py writes it into the planned config; unresolved: gathered, the rule's
    first choice). Its memory's calls and cache; temporaries are not timed."""
    hf, layout = planning.hf_config, cfg.generation.layout
    memory = generation_memory(cfg, hf, step, 0, "gathered" if layout == "auto" else layout)
    return generation_time(cfg, hf, step, memory, rates(cfg))


def kept_logps_seconds(cfg: Config, step: StepMemory) -> float:
    """The forwards over a generation's completions that compute the log-probabilities the update keeps (GRPO's:
    the reference's, the old policy's), each the update's forward without backward."""
    made = planned_generation(cfg)
    forwards = made.kept_forwards if made is not None else 0
    if not forwards:
        return 0.0
    offload = cfg.fsdp.cpu_offload
    one = sum(part_time(part, step.work[0, part], rates(cfg), offload).total
              for part in ("pre", "forward", "post", "loss") if (0, part) in step.work)
    return forwards * cfg.data.grad_accum_steps * one


def step_tokens(cfg: Config) -> int:
    """Tokens a step trains on at full rows (packed rows, or the longest row of a padded batch)."""
    return (update_rows(cfg) * cfg.data.context_length * cfg.data.grad_accum_steps
            * row_takers(cfg, cfg.hardware.world_size))


def dataset_records(cfg: Config) -> int | None:
    """The recipe's `data.records`, else the lines of its local JSON-lines file (a hub dataset is never read)."""
    if cfg.data.records:
        return cfg.data.records
    path = Path(cfg.data.path)
    if not cfg.data.sources and path.suffix == ".jsonl" and path.is_file():
        with path.open("rb") as lines:
            return sum(1 for line in lines if line.strip())
    return None


def epoch_line(cfg: Config, step_seconds: float) -> str:
    """One epoch's time: a record a row, or packed rows of `mean_record_tokens`-token records."""
    records = dataset_records(cfg)
    if records is None:
        return "one epoch: set data.records (and, with packing, data.mean_record_tokens) to see its time"
    rows_per_step = cfg.data.micro_batch * cfg.data.grad_accum_steps * row_takers(cfg, cfg.hardware.world_size)
    made = planned_generation(cfg)
    if made is not None:  # a record is a prompt; a generation serves `steps_served` steps
        steps = math.ceil(records / rows_per_step) * made.steps_served
        return f"one epoch of {records:,} prompts: {steps:,} steps, {hours(steps * step_seconds)}"
    if cfg.data.packing and not cfg.data.mean_record_tokens:
        steps = math.ceil(records / rows_per_step)
        return (f"one epoch of {records:,} records: at most {steps:,} steps, {hours(steps * step_seconds)} (a record "
                "a row; packing puts several in a row: set data.mean_record_tokens for the packed figure)")
    tokens = records * (cfg.data.mean_record_tokens or 0)
    rows = math.ceil(tokens / cfg.data.context_length) if cfg.data.packing else records
    steps = math.ceil(rows / rows_per_step)
    return f"one epoch of {records:,} records: {steps:,} steps, {hours(steps * step_seconds)}"


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def link_description(gpu: GPU) -> str:
    """The links the collectives and copies cross (hardware.pcie_gen and hardware.pcie_lanes override the card's)."""
    pcie = f"PCIe {gpu.pcie_gen}.0 x{gpu.pcie_lanes}"
    if gpu.nvlink_gbps:
        return f"NVLink {gpu.nvlink_gbps:.0f} GB/s each way, {pcie} to the host"
    return pcie if gpu.peer_to_peer else f"{pcie}, no peer-to-peer: collectives through host memory"


LAYOUT_WORDS = {"per_token": "the weights gathered layer by layer every token",
                "gathered": "the whole model gathered once a step, each rank decoding its own rows",
                "split": "each rank holding its share of the layers, every rank's rows passed through them in turn"}


def generation_lines(planning: Planning, cfg: Config, step: StepMemory) -> list[str]:
    """GRPO: the layout, what generating costs a rank per call and per decoding step, and what bounds a step."""
    made = recipe_generation(planning, cfg, step)
    link = {"per_token": "the link: every layer all-gathered each step",
            "split": "the link: hidden states to each layer's owner and back"}.get(made.layout, "the link")
    gpu = ("the GPU: the fused kernels read each 4-bit weight once a step, and every kernel's launch gap" if made.fused
           else "the GPU: every weight dequantized into a buffer and read back each step")
    bound = max((made.decode_link, link), (made.decode_gpu, gpu),
                (made.decode_host, "the host issuing the step's kernels"))[1]
    calls = f"{made.calls} call{'s' if made.calls > 1 else ''}"
    setup = f"{made.setup:.2f} s to gather the model + " if made.setup else ""
    rounds = (f" + {made.rounds} round{'s' if made.rounds > 1 else ''} of tool results x {made.round_prefill:.2f} s "
              "re-reading the context" if made.rounds else "")
    return [f"generation, {made.layout} ({LAYOUT_WORDS[made.layout]}): {setup}{calls} a rank x ({made.prefill:.2f} "
            f"s over the prompts{rounds} + {made.new_tokens} decoding steps x {made.decode_step:.3f} s), every row to "
            f"max_completion_length; a decoding step takes link {made.decode_link:.3f} s, GPU {made.decode_gpu:.3f} "
            f"s, host {made.decode_host:.3f} s: bound by {bound}"]


def mfu_words(cfg: Config, held: Held, flops_per_token: int) -> tuple[float, str]:
    """FLOPs of a step (trained tokens at 6N or 8N; GRPO's generated tokens at 2N, priced to their limit)."""
    trained = step_tokens(cfg) * flops_per_token * held.active_parameters
    active = ", N the active parameters" if held.active_parameters < held.base_parameters else ""
    made = planned_generation(cfg)
    if made is None:
        return trained, f"{flops_per_token}N FLOP a token{active}"
    generated = row_takers(cfg, cfg.hardware.world_size) * made.completions * made.new_tokens
    words = f"{flops_per_token}N FLOP a token, 2N a generated one{active}"
    return trained + generated * 2 * held.active_parameters, words


def time_lines(planning: Planning, cfg: Config, held: Held, step: StepMemory) -> list[str]:
    """The table of the step's time and the run's, for a GPU recipe (none on the CPU: no rates to price with)."""
    gpu = gpu_spec(cfg)
    if not gpu.priced:
        return []
    time = recipe_time(planning, cfg, step)
    tokens = step_tokens(cfg)
    rate = tokens / time.total
    flops_per_token = planned_flops_per_token(cfg)  # DPO's reference forward: 2N more, as training counts
    flops, flop_words = mfu_words(cfg, held, flops_per_token)
    mfu = flops / time.total / (gpu.bf16_tflops * 1e12 * cfg.hardware.world_size)
    grpo = planned_generation(cfg) is not None
    rows = [("matmuls (each on the roofline: FLOPs or bytes, whichever is slower)", time.matmul),
            ("attention", time.attention), ("element-wise ops (bytes read and written)", time.elementwise),
            ("4-bit dequantization", time.dequant),
            ("collectives on their own (all-gather, reduce-scatter)", time.collectives),
            ("host<->GPU copies on their own (offload)", time.copies), ("optimizer update", time.optimizer),
            ("transfers left exposed after overlapping the compute", time.exposed)]
    if grpo:
        rows.append(("generation (completions, and log-probabilities kept from it)", time.generation))
    if time.vision:
        rows.append(("the vision tower's forward over the images (an estimate, high)", time.vision))
    unpriced = "; the network between nodes is not priced: optimistic" if cfg.hardware.nodes > 1 else ""
    trained = "trained tokens" if grpo else "tokens"
    return ["", f"time per optimizer step on {cfg.hardware.world_size} x {cfg.hardware.gpu} ({link_description(gpu)}"
                f"{unpriced}), predicted from the step's counted work (docs/benchmarks/step-time.md compares the "
                "model with published runs):",
            "| part | seconds |", "| --- | ---: |", *(f"| {name} | {seconds:.2f} |" for name, seconds in rows),
            f"| **step** | **{time.total:.2f}** |", *(generation_lines(planning, cfg, step) if grpo else []),
            f"{tokens:,} {trained} a step: {rate:,.0f} tokens/s, MFU {mfu:.0%} ({flop_words}); "
            f"train.max_steps {cfg.train.max_steps}: {hours(cfg.train.max_steps * time.total)}",
            epoch_line(cfg, time.total)]
