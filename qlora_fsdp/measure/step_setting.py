"""What a recipe's measured step reads, as the key a plan keeps the measurement under: the architecture, and every
recipe key but those the step never reads (STEP_UNREAD) and the sections of objectives other than the recipe's.

A key left out that the step reads would hand a plan another setting's step; so the key is the whole recipe less
an explicit list, and tests/test_step_setting.py turns every key of a tiny recipe, one at a time, and holds the key
to the measured step: it changes where the step does, and nowhere else (but for the keys it names that the tiny
recipe cannot show: a mixture of experts' keys on a dense model).
"""

from __future__ import annotations

import json
from typing import Any

from transformers import PretrainedConfig

from qlora_fsdp.config import Config, to_dict
from qlora_fsdp.config.objectives import OBJECTIVE_SECTIONS
from qlora_fsdp.measure.fake_step import planned_objective
from qlora_fsdp.objectives.base import Objective

# the keys the step never reads, by what they are for instead
STEP_UNREAD = frozenset({
    # where the weights come from, and whether they may be read: the architecture is in the key itself
    "model.path", "model.trust_remote_code", "model.init", "model.allow_pickle", "model.unchecked_family",
    "model.adapter", "fsdp_preset",  # the preset's keys are fsdp.*, in the key
    # values, not shapes: the 4-bit code and the LoRA scale and initialisation
    "quant.quant_type", "lora.alpha", "lora.use_rslora", "lora.init", "lora.loftq_iter",
    # the image side (measure/image_side.py's own key)
    "quant.vision_tower", "lora.train_projector", "lora.target_vision_tower", "data.images_per_row",
    "data.image_min_pixels", "data.image_max_pixels",
    # the optimizer's numbers (its state's bytes follow optim.name) and the schedule
    "optim.lr", "optim.weight_decay", "optim.betas", "optim.eps", "optim.max_grad_norm", "optim.scheduler",
    "optim.warmup_steps", "optim.warmup_ratio", "optim.min_lr_ratio", "optim.lr_scaling", "optim.lr_base_batch",
    "optim.loss_scale_init", "optim.loss_scale_growth_interval", "lora.embeddings_lr", "lora.plus_ratio",
    # which records, and how many: the step is priced at full rows of data.context_length tokens
    "data.path", "data.format", "data.fields", "data.sources", "data.eval_path", "data.template",
    "data.train_on_inputs", "data.overlong", "data.group_by_length", "data.eval_samples", "data.eval_batch_size",
    "data.cache_dir", "data.num_proc", "data.records", "data.mean_record_tokens",
    # the batch as the user states it: the step reads it resolved (data.micro_batch_size, data.grad_accum_steps)
    "data.effective_batch", "data.effective_batch_tokens",
    # the run around the steps
    "train.max_steps", "train.eval_every", "train.log_every", "train.seed", "train.output_dir", "train.overwrite",
    "train.save_every", "train.keep_last", "train.resume", "train.max_bad_steps", "train.collective_timeout_minutes",
    "train.first_collective_timeout_s", "train.compile",
    "train.neftune_alpha",  # NEFTune's noise: a hook on the built model's embeddings, not on the planned one's
    # the GPU's size and speed and the host's: the plan's, not the step's (the dtypes they resolve are in the key)
    "hardware.gpu", "hardware.gpu_memory_gib", "hardware.host_ram_gib", "hardware.host_memory_gbps",
    "hardware.pcie_gen", "hardware.pcie_lanes",
    "logging.tensorboard", "logging.wandb", "logging.plot", "profile.memory", "profile.trace", "profile.steps",
})


def step_setting(cfg: Config, hf_config: PretrainedConfig) -> str:
    """The key of `cfg`'s measured step (`cfg` resolved: its dtypes and micro-batch as the step runs them)."""
    tree = to_dict(cfg)
    for dotted in STEP_UNREAD:
        section, _, key = dotted.partition(".")
        if key:
            del tree[section][key]
        else:
            del tree[section]
    own = planned_objective(cfg).SECTIONS
    for section in OBJECTIVE_SECTIONS:
        if section not in own:
            del tree[section]
    tree["data"]["grad_accum_steps"] = measured_accumulation(cfg)
    tree["activation_checkpointing"] = checkpointing_read(cfg, hf_config.num_hidden_layers)
    if cfg.export.target == "none":
        del tree["export"]["rounding_kernel"]  # the kernel of an export's rounding the step does not run
    architecture = hf_config.to_dict()
    architecture.pop("_name_or_path", None)  # the folder it was read from: a copy of the model is the same model
    architecture.pop("use_cache", None)  # building a model turns it off; a training step never reads it
    return json.dumps([architecture, tree], sort_keys=True, default=repr)


def checkpointing_read(cfg: Config, n_layers: int) -> dict[str, Any]:
    """The checkpointing settings as the step reads them: which layers are wrapped, not the keys that chose them
    (mode, and every_n, first_last, layers: each read in its own mode alone)."""
    policy = cfg.activation_checkpointing
    kept = {key: value for key, value in to_dict(cfg)["activation_checkpointing"].items()
            if key not in ("mode", "every_n", "first_last", "layers")}
    return {**kept, "wrapped": [index for index in range(n_layers) if policy.wraps(index, n_layers)]}


def measured_accumulation(cfg: Config) -> Any:
    """What the step reads of the accumulation: the micro-batches it runs (the first, the last), and with an
    export target the whole count (the export's search is priced once a step, a share of the first micro-batch)."""
    accumulation = cfg.data.grad_accum_steps
    return accumulation if cfg.export.target != "none" else min(accumulation, Objective.PLANNED_MICRO_BATCHES)
