"""The memory levers and, for a misfit, the single changes that make a recipe fit, most throughput kept first."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from qlora_fsdp.config import Config
from qlora_fsdp.errors import ConfigError, ModelLoadError
from qlora_fsdp.measure.held import Held, meta_held
from qlora_fsdp.measure.planning import Planning
from qlora_fsdp.plan.memory import GIB, Plan, gpu_spec, plan
from qlora_fsdp.plan.time_report import recipe_time, step_tokens

# selective checkpointing scopes, least recompute first: element-wise ops only, then attention (about a fifth of a
# Llama layer's matmul FLOPs), then the MLP, then the whole layer
SCOPES_BY_RECOMPUTE = ("ops", "attention", "mlp", "layer")
# rows longer than this get the tiled MLP offered (below it the MLP's intermediates are not what limits a row), in
# tiles of these sizes, the faster first: 4,096-token tiles planned the same as 1,024-token ones at 81,920 and 98,304
# tokens; 16,384-token ones run faster and, once the peak has moved to attention, plan the same as 4,096
# (docs/benchmarks/memory.md)
LONG_ROW, MLP_TILES = 8192, (16384, 4096)


def memory_levers(cfg: Config) -> list[tuple[str, dict[str, object]]]:
    """The loss and activation levers, the ones that cost the least throughput first."""
    policy = cfg.activation_checkpointing
    changes: list[tuple[str, dict[str, object]]] = []
    if not cfg.loss.chunked:  # recomputes only the output layer, a chunk at a time
        changes.append(("loss.chunked=true", {"loss.chunked": True}))
    if policy.mode != "off" and not policy.offload:  # copies that overlap compute; nothing recomputed
        changes.append(("activation_checkpointing.offload=true (what checkpointing keeps waits in host memory)",
                        {"activation_checkpointing.offload": True}))
    if not policy.mlp_tile_tokens and cfg.data.context_length > LONG_ROW and not cfg.lora.dropout:
        changes += [(f"activation_checkpointing.mlp_tile_tokens={tile} (the MLP over the row {tile:,} tokens at a "
                     "time; its forward runs once more)", {"activation_checkpointing.mlp_tile_tokens": tile})
                    for tile in MLP_TILES if tile < cfg.data.context_length]
    if not policy.attention_tile_tokens and cfg.data.context_length > LONG_ROW and not cfg.lora.dropout:
        tile = MLP_TILES[0] if MLP_TILES[0] < cfg.data.context_length else MLP_TILES[1]
        changes.append((f"activation_checkpointing.attention_tile_tokens={tile} (the norms and attention projections "
                        f"over the row {tile:,} tokens at a time; their forward runs once more)",
                        {"activation_checkpointing.attention_tile_tokens": tile}))
    if splits_rows_further(cfg):
        node = cfg.hardware.gpus_per_node
        changes.append((f"fsdp.context_parallel={node} (each row split over the {node} GPUs of a node; rows a step "
                        f"/ {node // cfg.fsdp.context_parallel})", {"fsdp.context_parallel": node}))
    current = SCOPES_BY_RECOMPUTE.index(policy.scope) if policy.mode == "every_layer" else -1
    for scope in SCOPES_BY_RECOMPUTE[current + 1:]:
        what = "every layer" if scope == "layer" else f"{'element-wise ops' if scope == 'ops' else scope} only"
        changes.append((f"activation_checkpointing.mode=every_layer activation_checkpointing.scope={scope} "
                        f"(recomputes {what})", {"activation_checkpointing.mode": "every_layer",
                                                 "activation_checkpointing.scope": scope}))
    return changes


def splits_rows_further(cfg: Config) -> bool:
    """Long rows, on a node whose GPUs do not all share each row yet (rollouts with tools are not split)."""
    tool_rollouts = cfg.multi_turn_rollouts
    return (cfg.data.context_length > LONG_ROW and not tool_rollouts
            and cfg.model.attn_implementation in ("auto", "sdpa_varlen")
            and cfg.hardware.gpus_per_node > cfg.fsdp.context_parallel
            and cfg.hardware.gpus_per_node % cfg.fsdp.context_parallel == 0)


def variants(cfg: Config, batch_from_target: bool = False) -> list[tuple[str, dict[str, object], Config]]:
    """Changes that shrink the footprint, the ones that keep the most throughput first: (words, the keys a user
    sets, the changed config). With `batch_from_target` the recipe states an effective batch, so only the
    micro-batch is the user's to set."""
    changes = memory_levers(cfg)
    if cfg.data.micro_batch > 1:
        half, accum = max(1, cfg.data.micro_batch // 2), cfg.data.grad_accum_steps * 2
        label = (f"data.micro_batch_size={half} (the effective batch then takes {accum} accumulation steps)"
                 if batch_from_target else
                 f"data.micro_batch_size={half} data.grad_accum_steps={accum} (same effective batch)")
        changes.append((label, {"data.micro_batch_size": half, "data.grad_accum_steps": accum}))
    if cfg.data.context_length > 512:
        changes.append((f"data.context_length={cfg.data.context_length // 2}",
                        {"data.context_length": cfg.data.context_length // 2}))
    if cfg.lora.r > 8:
        changes.append((f"lora.r={cfg.lora.r // 2}", {"lora.r": cfg.lora.r // 2}))
    if not cfg.fsdp.cpu_offload:
        changes.append(("fsdp_preset=full_shard_cpu_offload (slower: the optimizer step runs on the CPU)",
                        {"fsdp.cpu_offload": True}))
    out = []
    for label, values in changes:
        changed = copy.deepcopy(cfg)
        for dotted, value in values.items():
            section, key = dotted.split(".")
            setattr(getattr(changed, section), key, value)
        # an effective batch derives the accumulation steps: the user sets only the micro-batch
        keys = {k: v for k, v in values.items() if not (batch_from_target and k == "data.grad_accum_steps")}
        out.append((label, keys, changed))
    return out


def time_cost(planning: Planning, cfg: Config, base: Plan, changed: Config, result: Plan) -> str:
    """", +12% time a token": what the change costs in speed against the recipe as written (per token, since a
    smaller micro-batch or context also changes the tokens of a step); empty where the GPU has no rates."""
    if not gpu_spec(cfg).priced or base.step is None or result.step is None:
        return ""
    before = recipe_time(planning, cfg, base.step).total / step_tokens(cfg)
    after = recipe_time(planning, changed, result.step).total / step_tokens(changed)
    return f", {after / before - 1:+.0%} time a token"


@dataclass(frozen=True)
class Lever:
    """One change that makes a misfit fit: its words, its keys (dotted key -> value), the GiB a GPU it gives and
    its cost in speed ("" where the GPU has no rates)."""

    label: str
    overrides: dict[str, object]
    gpu_gib: float
    cost: str

    def __str__(self) -> str:
        return f"{self.label}: {self.gpu_gib:.1f} GiB a GPU{self.cost}"


def fitting_levers(planning: Planning, cfg: Config, held: Held, mesh: DeviceMesh,
                   batch_from_target: bool = False) -> list[Lever]:
    """Each single change that makes a misfit fit, the ones that keep the most throughput first."""
    found = []
    base = plan(planning, cfg, held)
    for label, values, changed in variants(cfg, batch_from_target):
        same_shapes = changed.lora.r == cfg.lora.r  # only the rank changes what is allocated
        try:
            result = plan(planning, changed, held if same_shapes else meta_held(planning, mesh, changed))
        except (ConfigError, ModelLoadError):  # a lever this architecture lacks (a sub-layer scope it has no module
            # for, heads that do not divide over a split row)
            continue
        if result.fits:
            found.append(Lever(label, values, result.gpu_total / GIB, time_cost(planning, cfg, base, changed, result)))
    return found
