"""Checks across a recipe's keys that their types alone cannot express (run once, at load)."""

from __future__ import annotations

from qlora_fsdp.config.generating_checks import validate_generating
from qlora_fsdp.config.schema import LORA_INITS, PISSA_FAST, Config, changes_base
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.optimizer_registry import OPTIMIZERS


def validate(config: Config) -> Config:
    """Checks across fields that types alone cannot express."""
    positive = {
        "data.grad_accum_steps": config.data.grad_accum_steps,
        "data.context_length": config.data.context_length,
        "data.eval_batch_size": config.data.eval_batch_size,
        "train.max_steps": config.train.max_steps,
        "lora.r": config.lora.r,
        "activation_checkpointing.every_n": config.activation_checkpointing.every_n,
        "activation_checkpointing.first_last": config.activation_checkpointing.first_last,
        "loss.chunk_tokens": config.loss.chunk_tokens,
        "quant.blocksize": config.quant.blocksize,
        "train.keep_last": config.train.keep_last,
        "train.max_bad_steps": config.train.max_bad_steps,
        "hardware.gpus_per_node": config.hardware.gpus_per_node,
        "hardware.nodes": config.hardware.nodes,
        "profile.steps": config.profile.steps,
        "optim.loss_scale_growth_interval": config.optim.loss_scale_growth_interval,
    }
    optional_positive = {
        "data.micro_batch_size": None if config.data.micro_batch_size == "auto" else config.data.micro_batch_size,
        "data.effective_batch": config.data.effective_batch,
        "data.effective_batch_tokens": config.data.effective_batch_tokens,
        "optim.lr_base_batch": config.optim.lr_base_batch,
        "fsdp.shard_size": config.fsdp.shard_size,
        "fsdp.context_parallel": config.fsdp.context_parallel,
    }
    positive.update({key: value for key, value in optional_positive.items() if value is not None})
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"'{key}' must be at least 1, got {value}")
    if config.fsdp.param_dtype not in (None, "bfloat16"):
        # the packed 4-bit bytes are never cast (uint8 storage); bf16 is the one compute policy tested end to end
        raise ConfigError(f"'fsdp.param_dtype' must be null or bfloat16, got {config.fsdp.param_dtype!r}")
    if config.optim.name not in OPTIMIZERS:
        raise ConfigError(f"'optim.name' must be one of {', '.join(repr(n) for n in OPTIMIZERS)}, got "
                          f"{config.optim.name!r}")
    if config.optim.lr <= 0:
        raise ConfigError(f"'optim.lr' must be positive, got {config.optim.lr}")
    if config.optim.loss_scale_init <= 0:
        raise ConfigError(f"'optim.loss_scale_init' must be positive, got {config.optim.loss_scale_init}")
    if config.train.collective_timeout_minutes <= 0:
        raise ConfigError("'train.collective_timeout_minutes' must be positive, got "
                          f"{config.train.collective_timeout_minutes}")
    if config.train.first_collective_timeout_s <= 0:
        raise ConfigError("'train.first_collective_timeout_s' must be positive, got "
                          f"{config.train.first_collective_timeout_s}")
    _validate_peer_options(config)
    _validate_batch(config)
    _validate_warmup(config)
    _validate_preference(config)
    validate_generating(config)
    _validate_compile(config)
    _validate_checkpointing(config)
    _validate_context_parallel(config)
    _validate_export(config)
    _validate_cadence(config)
    return config


def _validate_cadence(config: Config) -> None:
    """How often a run logs and saves."""
    if config.train.log_every < 1:
        raise ConfigError(f"'train.log_every' must be 1 (every step) or more, got {config.train.log_every}")
    if config.train.save_every < 0:
        raise ConfigError(f"'train.save_every' must be 0 (only at the end) or more, got {config.train.save_every}")


def _validate_init(config: Config) -> None:
    """lora.init: a known one, with settings it can start."""
    init, lora = config.lora.init, config.lora
    fast = init.startswith(PISSA_FAST) and init.removeprefix(PISSA_FAST).isdigit() and int(
        init.removeprefix(PISSA_FAST)) > 0
    if init not in LORA_INITS and not fast:
        raise ConfigError(f"'lora.init' must be one of {', '.join(LORA_INITS)} or {PISSA_FAST}<iterations> (e.g. "
                          f"{PISSA_FAST}4), got {init!r}")
    if lora.loftq_iter < 1:
        raise ConfigError(f"'lora.loftq_iter' must be at least 1, got {lora.loftq_iter}")
    if init == "eva" and (config.train.kind.generates or lora.target_experts or lora.target_vision_tower):
        raise ConfigError("'lora.init: eva' starts A from the training rows' layer inputs: not built for GRPO's "
                          "prompts, LoRA on experts or on a vision tower; use lora.init: default")
    if not changes_base(init):
        return
    clashes = {"lora.use_dora": lora.use_dora, "lora.target_experts": lora.target_experts,
               "lora.target_vision_tower": lora.target_vision_tower, "model.adapter": bool(config.model.adapter)}
    for key, clashing in clashes.items():
        if clashing:
            raise ConfigError(f"'lora.init: {init}' with {key}: that start is not built for it yet; use lora.init: "
                              "default, or leave out " + key)
    if init == "loftq" and config.quant.quant_type != "nf4":
        raise ConfigError("'lora.init: loftq' alternates with NF4 quantization (as PEFT's); set quant.quant_type: nf4")


def _validate_peer_options(config: Config) -> None:
    """LoRA+, NEFTune, trained embeddings, lora.init."""
    _validate_init(config)
    if config.model.add_tokens and not config.lora.train_embeddings:
        raise ConfigError("'model.add_tokens' adds rows to the embeddings and the head that nothing would train; set "
                          "lora.train_embeddings: true")
    if config.lora.embeddings_lr is not None and (config.lora.embeddings_lr <= 0 or not config.lora.train_embeddings):
        raise ConfigError(f"'lora.embeddings_lr' must be positive and goes with lora.train_embeddings: true, got "
                          f"{config.lora.embeddings_lr}")
    if config.lora.plus_ratio is not None and config.lora.plus_ratio <= 0:
        raise ConfigError(f"'lora.plus_ratio' must be positive (LoRA+ suggests 16), or null for one learning rate, "
                          f"got {config.lora.plus_ratio}")
    alpha = config.train.neftune_alpha
    if alpha is None:
        return
    if alpha <= 0:
        raise ConfigError(f"'train.neftune_alpha' must be positive (NEFTune tried 5 to 15), or null for no noise, "
                          f"got {alpha}")
    if config.train.kind.generates:
        raise ConfigError(f"'train.neftune_alpha' with train.objective {config.train.objective}: the update's "
                          "log-probabilities would be noised and generation's not; remove train.neftune_alpha")
    if config.fsdp.context_parallel > 1:
        raise ConfigError("'train.neftune_alpha' with fsdp.context_parallel: the noise's scale needs the whole "
                          "row's length, which a rank of a split does not see; use fsdp.context_parallel: 1")


def _validate_checkpointing(config: Config) -> None:
    checkpointing = config.activation_checkpointing
    for key in ("mlp_tile_tokens", "attention_tile_tokens"):
        if getattr(checkpointing, key) < 0:
            raise ConfigError(f"'activation_checkpointing.{key}' must be 0 (whole rows) or more, got "
                              f"{getattr(checkpointing, key)}")
    if checkpointing.mode == "layers" and (not checkpointing.layers or min(checkpointing.layers) < 0):
        raise ConfigError("'activation_checkpointing.mode: layers' needs 'activation_checkpointing.layers', a list "
                          f"of 0-based layer indices, got {checkpointing.layers}")


def _validate_context_parallel(config: Config) -> None:
    degree = config.fsdp.context_parallel
    if degree == 1:
        return
    if config.multi_turn_rollouts:
        raise ConfigError(f"'fsdp.context_parallel: {degree}' with GRPO's tools or environments: multi-turn rollouts "
                          "across a split are not built yet; use fsdp.context_parallel: 1")
    if config.model.attn_implementation not in ("auto", "sdpa_varlen"):
        raise ConfigError(f"'fsdp.context_parallel: {degree}' runs the per-sample kernel between its all-to-alls, "
                          f"not {config.model.attn_implementation!r}; use model.attn_implementation: auto")


def _validate_preference(config: Config) -> None:
    preference, objective, kind = config.preference, config.train.objective, config.train.kind
    if preference.resolved_beta(objective) <= 0:
        raise ConfigError(f"'preference.beta' must be positive, got {preference.beta}")
    if not 0 <= preference.label_smoothing < 0.5:
        raise ConfigError(f"'preference.label_smoothing' must be at least 0 and below 0.5, got "
                          f"{preference.label_smoothing}")
    if kind.whole_samples and config.data.overlong == "split":
        raise ConfigError("'data.overlong: split' cuts samples into pieces, which a preference pair cannot be; use "
                          "truncate or drop")
    if kind.unpaired and min(preference.desirable_weight, preference.undesirable_weight) < 0:
        raise ConfigError(f"'preference.desirable_weight' and 'preference.undesirable_weight' must be 0 or more, got "
                          f"{preference.desirable_weight} and {preference.undesirable_weight}")
    if kind.unpaired and config.data.format != "chat":
        raise ConfigError(f"'train.objective: kto' reads records of a prompt, a completion and a label "
                          f"('data.format: chat'), got format {config.data.format}")
    if kind.reference and config.model.adapter and preference.reference == "adapter_off":
        raise ConfigError("'preference.reference: adapter_off' would compare against the base without "
                          "model.adapter's weights; use precomputed (or auto, which then precomputes)")
    if kind.reference and config.lora.train_router and preference.reference == "adapter_off":
        raise ConfigError("'preference.reference: adapter_off' would compare against the trained routers, which "
                          "the adapter switch leaves on; use precomputed (or auto, which then precomputes)")
    if kind.whole_samples and config.data.train_on_inputs:
        raise ConfigError("'data.train_on_inputs: true' trains on prompts, which a preference objective never "
                          "does; remove it")


def _validate_compile(config: Config) -> None:
    checkpointing = config.activation_checkpointing
    if config.train.compile and (checkpointing.scope != "layer" or checkpointing.offload):
        raise ConfigError("'train.compile: true' is tested with whole-layer checkpointing only; set "
                          "'activation_checkpointing.scope: layer' and 'offload: false', or 'train.compile: false'")


def _validate_batch(config: Config) -> None:
    data, optim = config.data, config.optim
    if data.effective_batch is not None and data.effective_batch_tokens is not None:
        raise ConfigError("set one of 'data.effective_batch' (rows) and 'data.effective_batch_tokens', not both")
    has_target = data.effective_batch is not None or data.effective_batch_tokens is not None
    if has_target and data.grad_accum_steps != 1:
        raise ConfigError(f"'data.grad_accum_steps: {data.grad_accum_steps}' and an effective batch are both set; "
                          "the effective batch derives the steps: remove one (or pass data.grad_accum_steps=1)")
    if data.micro_batch_size == "auto" and not has_target:
        raise ConfigError("'data.micro_batch_size: auto' needs a target: set 'data.effective_batch' (rows per "
                          "optimizer step) or 'data.effective_batch_tokens'")
    if optim.lr_scaling != "none" and optim.lr_base_batch is None:
        raise ConfigError(f"'optim.lr_scaling: {optim.lr_scaling}' needs 'optim.lr_base_batch', the effective "
                          "batch (rows) that optim.lr was tuned for")
    if config.data.images_per_row < 0:
        raise ConfigError(f"'data.images_per_row' must be 0 (text only) or more, got {config.data.images_per_row}")
    low, high = config.data.image_min_pixels, config.data.image_max_pixels
    if (low is not None and low < 1) or (high is not None and high < 1) or (low and high and low > high):
        raise ConfigError(f"'data.image_min_pixels' ({low}) and 'data.image_max_pixels' ({high}) must be positive, "
                          "min at most max")


def _validate_warmup(config: Config) -> None:
    optim = config.optim
    if not 0 <= optim.warmup_ratio < 1:
        raise ConfigError(f"'optim.warmup_ratio' must be at least 0 and below 1 (a fraction of train.max_steps), "
                          f"got {optim.warmup_ratio}")
    if optim.warmup_steps and optim.warmup_ratio:
        raise ConfigError(f"'optim.warmup_steps: {optim.warmup_steps}' and 'optim.warmup_ratio: "
                          f"{optim.warmup_ratio}' are both set: keep one (the other 0)")


def _validate_export(config: Config) -> None:
    """export.target trains through the merged weight, which exists for plain LoRA on the 4-bit linears only."""
    if config.export.target == "none":
        return
    lora = config.lora
    blockers = {"lora.dropout > 0 (the exported weight has no dropout)": lora.dropout > 0,
                "lora.use_dora": lora.use_dora, "lora.train_embeddings": lora.train_embeddings,
                "lora.target_experts": lora.target_experts, "lora.train_router": lora.train_router,
                "lora.target_vision_tower": lora.target_vision_tower, "lora.train_projector": lora.train_projector}
    found = [name for name, on in blockers.items() if on]
    if found:
        raise ConfigError(f"export.target: {config.export.target} trains through the merged 4-bit linears, which "
                          f"{found[0]} leaves; turn that off or set export.target: none")
