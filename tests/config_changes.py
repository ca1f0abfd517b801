"""One valid change of every recipe key of a config (`changes`): what the cache-key tests turn, one key at a time."""

from __future__ import annotations

import dataclasses
import json
import tempfile
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from qlora_fsdp.config import Config, load_config, to_yaml

# keys whose type alone gives no valid other value for the tiny recipes (free text, paths, cross-checked numbers)
CHOSEN: dict[str, object] = {
    "fsdp_preset": "full_shard_cpu_offload", "model.path": "models/tiny-llama-copy",
    "model.adapter": "outputs/some_adapter",
    "model.add_tokens": ["<extra>"], "model.dtype": "bfloat16", "model.attn_implementation": "eager",
    "quant.compute_dtype": "bfloat16", "quant.skip_modules": [],
    "lora.target_modules": ["q_proj", "v_proj"], "lora.init": "pissa", "lora.plus_ratio": 16.0,
    "lora.embeddings_lr": 1e-5, "lora.dtype": "bfloat16",
    "fsdp.param_dtype": "bfloat16", "fsdp.reduce_dtype": "bfloat16", "fsdp.shard_size": 1,
    "fsdp.context_parallel": 2,
    "activation_checkpointing.mode": "first_last", "activation_checkpointing.layers": [1],
    "activation_checkpointing.every_n": 3, "activation_checkpointing.first_last": 2,
    "activation_checkpointing.mlp_tile_tokens": 32, "activation_checkpointing.attention_tile_tokens": 32,
    "loss.chunk_tokens": 64, "preference.beta": 0.3, "preference.center_rewards_coefficient": 0.01,
    "generation.stop": ["</answer>"], "generation.rows": 4,
    "grpo.rewards": [{"function": "math_answer"}], "grpo.epsilon_high": 0.28, "grpo.delta": 2.0,
    "grpo.tools": ["tests.fixtures.tools:add"], "grpo.environment": "tests.fixtures.environments:Counter",
    "grpo.environments": {"counter": "tests.fixtures.environments:Counter"},
    "grpo.max_tool_calling_iterations": 3,
    "rloo.rewards": [{"function": "math_answer"}], "rloo.epsilon_high": 0.28, "rloo.reward_clip_range": [-1.0, 1.0],
    "optim.name": "adamw", "optim.betas": [0.8, 0.99], "optim.max_grad_norm": None, "optim.lr_base_batch": 64,
    "optim.lr_scaling": "linear",
    "data.path": "data/tiny_instruct_copy.jsonl", "data.fields": {"output": "response"},
    "data.sources": [{"path": "data/tiny_instruct.jsonl"}], "data.eval_path": "data/tiny_eval.jsonl",
    "data.template": "chatml", "data.micro_batch_size": 2, "data.grad_accum_steps": 2,
    "data.effective_batch": 32, "data.effective_batch_tokens": 4096, "data.cache_dir": "/tmp/token_cache",
    "data.records": 1000, "data.mean_record_tokens": 60.0, "data.images_per_row": 1,
    "data.image_min_pixels": 3136, "data.image_max_pixels": 12544,
    "train.objective": "dpo", "train.output_dir": "outputs/elsewhere", "train.resume": "auto",
    "train.neftune_alpha": 5.0,
    "hardware.gpu": "rtx4090", "hardware.gpus_per_node": 1, "hardware.gpu_memory_gib": 20.0,
    "hardware.host_ram_gib": 64.0, "hardware.pcie_gen": 3, "hardware.pcie_lanes": 8,
    "logging.wandb": {"project": "p"}, "profile.steps": 2, "export.target": "q4_k_m",
}


def leaves(cfg: Config) -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, its value, its type) of every recipe key."""
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(value):
            yield section.name, value, str
            continue
        hints = typing.get_type_hints(type(value))
        for key in dataclasses.fields(value):
            yield f"{section.name}.{key.name}", getattr(value, key.name), hints[key.name]


def other_value(dotted: str, value: Any, hint: Any) -> object:
    """A value other than `value` that the recipe accepts."""
    if dotted in CHOSEN:
        return CHOSEN[dotted]
    if typing.get_origin(hint) is Literal:
        return next(choice for choice in typing.get_args(hint) if choice != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2 if value else 1
    if isinstance(value, float):
        return value / 2 if value else 0.1
    raise KeyError(f"tests/config_changes.py: choose a value for {dotted} in CHOSEN")


def changes(base: Config) -> Iterator[tuple[str, Config]]:
    """(dotted key, `base` with that key changed) for every recipe key."""
    for dotted, value, hint in leaves(base):
        yield dotted, changed(base, dotted, other_value(dotted, value, hint))


def changed(cfg: Config, dotted: str, value: object) -> Config:
    """`cfg` with one key set, its value built as the loader builds it (a list of sections, a number); set as given
    where the key alone is refused (it needs another key: the measurements read no validation)."""
    if "." not in dotted:
        return dataclasses.replace(cfg, **{dotted: value})
    section, key = dotted.split(".")
    overrides = [f"{dotted}={json.dumps(value)}"]
    try:
        built = getattr(load_config_like(cfg, overrides), section)
    except Exception:  # refused alone
        return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{key: value})})
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                    **{key: getattr(built, key)})})


def load_config_like(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` written as a recipe and loaded with `overrides` (validated as a user's would be)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "recipe.yaml"
        path.write_text(to_yaml(cfg))
        return load_config(str(path), overrides)
