"""Wiring: config -> sharded, loaded model -> data, optimizer -> trainer -> adapter. Used by train.py and notebooks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import peft
import torch
from transformers import PreTrainedTokenizerBase

from qlora_fsdp.auto_batch import resolve_run_batch
from qlora_fsdp.config import Config, load_config, to_dict, to_yaml, validate
from qlora_fsdp.data.kinds import TrainingData
from qlora_fsdp.data.training_data import load_training_data
from qlora_fsdp.distributed import DistInfo, decide_on_main, init_distributed
from qlora_fsdp.distributed.row_groups import row_split
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.families import check_images_split
from qlora_fsdp.layers.decoder import describe_attention
from qlora_fsdp.loading.adapter import export_adapter
from qlora_fsdp.loading.build import base_parameter_count
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.loading.image_side_training import trains_image_side
from qlora_fsdp.loading.vision_encoder import checkpoint_config, load_processor, load_vision_encoder
from qlora_fsdp.objectives.table import objective_class
from qlora_fsdp.objectives.tool_templates import prompt_tools
from qlora_fsdp.optimizer import build_optimizer, build_scheduler
from qlora_fsdp.outputs.checkpoints import Checkpointer, check_world_size
from qlora_fsdp.outputs.metrics import MetricsLogger, format_summary
from qlora_fsdp.outputs.plots import plot_loss_curves
from qlora_fsdp.outputs.run_card import RunCard, write_run_card
from qlora_fsdp.outputs.run_dir import prepare_run_dir
from qlora_fsdp.outputs.shared_dir import check_output_dir_shared
from qlora_fsdp.outputs.tracking import check_available as check_trackers_available
from qlora_fsdp.outputs.tracking import open_trackers
from qlora_fsdp.precision import describe_device, describe_dtypes
from qlora_fsdp.run.accelerators import peak_flops
from qlora_fsdp.run.batch_size import describe_batch
from qlora_fsdp.run.description import describe_run
from qlora_fsdp.training.eva_start import EvaBatches, eva_start
from qlora_fsdp.training.loop import Trainer
from qlora_fsdp.training.records import MfuReference, RunSummary


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, base) parameter counts of the whole model; a 4-bit weight counts its unpacked size."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad), base_parameter_count(model)


def train(config: Config | str, overrides: Sequence[str] = (), *, info: DistInfo | None = None,
          command: tuple[str, list[str]] | None = None) -> dict[str, Any]:
    """Train a recipe end to end, resuming where it says so; returns the summary. Every rank calls this.

    `config` is a Config, or a recipe name or YAML path (then with dotted `key=value` overrides), so a notebook
    runs `train("tiny_cpu", ["train.max_steps=20"])` down the very path of `train.py`. `command`: train.py's recipe
    and overrides as given, for the run's card (outputs/run_card.py; a recipe name's own otherwise).
    """
    cfg = load_config(config, overrides) if isinstance(config, str) else validate(config)
    check_trackers_available(cfg.logging)  # every rank, before anything is read
    objective_class(cfg).check_before_loading(cfg)  # GRPO: an unknown reward function, before any loading
    info = info or init_distributed(cfg.fsdp.shard_size, cfg.train.collective_timeout_minutes,
                                    first_collective_timeout_s=cfg.train.first_collective_timeout_s)
    row_split(cfg.fsdp.context_parallel)  # context parallel's groups, or one line now (too few ranks)
    run = describe_run(cfg, describe_device(info.device))  # the recipe resolved once: dtypes, then its batch
    cfg = run.cfg
    out_dir = Path(cfg.train.output_dir)
    checkpoint = decide_on_main(lambda: prepare_run_dir(out_dir, cfg.train))  # before any rank writes
    check_output_dir_shared(out_dir, info)  # across nodes: one folder every node sees, or one line now
    if checkpoint is not None:
        check_world_size(checkpoint, info.world_size)  # before minutes of loading, not after
    torch.manual_seed(cfg.train.seed)
    tokenizer = load_tokenizer(cfg)
    data = load_training_data(tokenizer, cfg, info, lambda: load_processor(cfg), prompt_tools(tokenizer, cfg))
    images = data.has_images
    check_image_levers(cfg, images)
    model = build_sharded_model(cfg, info)
    if images:  # the image side, frozen, beside the sharded decoder on every rank
        load_vision_encoder(model, cfg, info.device)
    run = run.with_batch(decide_on_main(lambda: resolve_run_batch(run.cfg, model, info)))  # auto micro-batch, lr
    cfg = run.cfg
    trainer = make_trainer(cfg, info, model, data, tokenizer,
                           command or (config if isinstance(config, str) else "", list(overrides)))
    trainer.logger.write(describe_dtypes(run.written, cfg, run.device))
    trainer.logger.write(describe_attention(model))
    trainer.logger.write(describe_batch(run.before_batch or cfg, cfg, info.world_size))
    if checkpoint is not None:
        trainer.resume(checkpoint)
    elif cfg.lora.init == "eva":  # A from the first micro-batches (a resumed run has its own in the checkpoint)
        filled = eva_start(model, EvaBatches(model, trainer.micro_batches, trainer.sampler, info.device))
        trainer.logger.write(f"EVA: {filled} LoRA layers' A from the first micro-batches' layer inputs")
    return finish(trainer, trainer.train(), tokenizer)


def check_image_levers(cfg: Config, images: bool) -> None:
    """What the data's images rule out, once the records are read."""
    if trains_image_side(cfg) and not images:
        raise ConfigError("lora.train_projector / lora.target_vision_tower train a vision-language checkpoint's "
                          "image side: the data's records show no images (image parts, or an `images` column)")
    if images and cfg.fsdp.context_parallel > 1:
        check_images_split(checkpoint_config(cfg), cfg.fsdp.context_parallel)
    if images and cfg.lora.init == "eva":
        raise ConfigError("'lora.init: eva' with images: the image features' layer inputs are not built yet; use "
                          "lora.init: default")


def make_trainer(cfg: Config, info: DistInfo, model: peft.PeftModel, data: TrainingData,
                 tokenizer: PreTrainedTokenizerBase, command: tuple[str, list[str]] = ("", [])) -> Trainer:
    """The loop over the built model and data; `command`: train.py's recipe and overrides as given, for the run's
    card, written with the start record (a run stopped by bad input before this leaves its folder untouched)."""
    out_dir = Path(cfg.train.output_dir)
    optimizer = build_optimizer(model, cfg.optim, cfg.lora)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
    trackers = open_trackers(cfg.logging, out_dir, to_dict(cfg)) if info.is_main else []
    logger = MetricsLogger(out_dir, cfg.train.max_steps, enabled=info.is_main, trackers=trackers)
    objective = objective_class(cfg)  # its metrics' names: both plotters draw what it logs
    logger.log({"event": "start", "world_size": info.world_size, "config": to_dict(cfg),
                "metrics": {"progress": list(objective.PROGRESS_METRICS), "eval": list(objective.EVAL_METRICS)}})
    if info.is_main:  # the folder says who trains into it, and how it was started
        write_run_card(out_dir, RunCard.of_this_process(*command, out_dir, info.world_size, to_dict(cfg)))
    trainable, base = count_parameters(model)
    logger.write(f"world size {info.world_size} on {info.device.type}; data: "
                 f"{data.describe(cfg.data.context_length, cfg.data.overlong)}")
    logger.write(f"LoRA parameters {trainable:,} on a {base:,}-parameter 4-bit base")
    checkpointer = Checkpointer(out_dir, info, cfg.train.keep_last, to_yaml(cfg), tokenizer, cfg.model.path)
    mfu_reference = MfuReference.for_run(base, peak_flops(info.device), info.world_size)
    trainer = Trainer(cfg, info, model, data, tokenizer.pad_token_id, optimizer, scheduler, logger, checkpointer,
                      mfu_reference, tokenizer=tokenizer)
    for note in trainer.profiler.notes():
        logger.write(note)
    return trainer


def finish(trainer: Trainer, summary: RunSummary, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Adapter (unless stopped by a signal), summary record, curves and the closing lines; the summary as a dict."""
    cfg, logger, info = trainer.cfg, trainer.logger, trainer.info
    out_dir = Path(cfg.train.output_dir)
    if summary.stopped_by_signal:
        logger.write(f"stopped at step {trainer.step}; checkpoint {trainer.last_checkpoint}; continue with --resume")
    else:
        export_adapter(trainer.model, tokenizer, out_dir / "adapter", cfg.model.path, info.is_main, to_yaml(cfg))
        summary.adapter = str(out_dir / "adapter")
    if trainer.profiler.written:
        summary.profile = str(out_dir / "profile")
    logger.log({"event": "summary", **summary.as_dict()})
    logger.close()
    if info.is_main and cfg.logging.plot and plot_loss_curves(logger.path, out_dir / "loss_curves.png"):
        summary.loss_curves = str(out_dir / "loss_curves.png")
    logger.write(format_summary(summary.as_dict()))
    return summary.as_dict()
