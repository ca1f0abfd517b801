"""Planned against measured peak memory per rank: the planner's step on fake tensors against the same step run.

For three small Llama architectures (config.json only, seeded random weights), every combination of the loss
(full logits, chunked), activation checkpointing (every layer, selective: per-operator, none) and activation
offload (off, on): the plan's peak of live tensor bytes on rank 0 of a fake world of 2 (training's step on fake
tensors under torch's FSDP2 memory tracker, as `--plan` measures it) against the peak the same tracker counts
when the very same step runs on real tensors. NF4 base, LoRA r=16 on every linear, paged 8-bit AdamW, packed
bf16 rows (tiny_cpu's training setup). Then, at every scale, the long-row levers on the chunked loss with every
layer checkpointed: the MLP in tiles, the row split over both ranks (context parallel), and both. The last line is
the ratio farthest from 1.

    python -m benchmarks.planner_memory                  # 45 configurations, about 8 minutes on 2 CPU cores
    python -m benchmarks.planner_memory --scales small   # 15 of them, about a minute
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig

from qlora_fsdp.config import Config, load_config
from qlora_fsdp.distributed import DistInfo, cleanup, init_fake_distributed
from qlora_fsdp.measure.fake_world import recipe_step
from qlora_fsdp.measure.planning import Planning
from qlora_fsdp.measure.real_step import measured_step

MIB = 2**20


@dataclass(frozen=True)
class Scale:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    context: int
    accumulation: int  # micro-batches a step: 2 runs one with gradient sync off, then one with it on

    def write(self, folder: Path) -> Path:
        LlamaConfig(hidden_size=self.hidden, intermediate_size=self.hidden * 8 // 3 // 16 * 16,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, vocab_size=self.vocab, max_position_embeddings=8192,
                    tie_word_embeddings=False).save_pretrained(folder)
        return folder

    def __str__(self) -> str:
        return f"{self.layers} x {self.hidden}, {self.context:,} tokens"


SCALES = {"small": Scale(4, 256, 4, 2, 8192, 1024, 2), "medium": Scale(6, 384, 6, 2, 16384, 2048, 2),
          "large": Scale(8, 512, 8, 4, 16384, 4096, 1)}
LOSSES = {"full": ["loss.chunked=false"], "chunked": ["loss.chunked=true"]}
CHECKPOINTING = {"every layer": ["activation_checkpointing.mode=every_layer"],
                 "selective (ops)": ["activation_checkpointing.mode=every_layer", "activation_checkpointing.scope=ops"],
                 "none": ["activation_checkpointing.mode='off'"]}
OFFLOAD = {"off": ["activation_checkpointing.offload=false"], "on": ["activation_checkpointing.offload=true"]}
TILES = ["activation_checkpointing.mlp_tile_tokens=256"]
SPLIT = ["fsdp.context_parallel=2"]
LONG_ROW_LEVERS = {"MLP in 256-token tiles": TILES, "row split over 2 ranks": SPLIT, "both": TILES + SPLIT}


def config(model_dir: Path, scale: Scale, overrides: list[str]) -> Config:
    return load_config("tiny_cpu", [f"model.path={model_dir}", "model.init=random", "hardware.gpus_per_node=2",
                                    "data.micro_batch_size=1", f"data.context_length={scale.context}",
                                    f"data.grad_accum_steps={scale.accumulation}", *overrides])


def row(name: str, scale: Scale, model_dir: Path, choice: tuple[str, str, str], info: DistInfo,
        lever: str = "") -> float:
    loss, checkpointing, offload = choice
    cfg = config(model_dir, scale,
                 LOSSES[loss] + CHECKPOINTING[checkpointing] + OFFLOAD[offload] + LONG_ROW_LEVERS.get(lever, []))
    planned = recipe_step(Planning.of(cfg)).peak
    measured = measured_step(cfg, info).peak
    gc.collect()
    ratio = planned / measured
    print(f"| {name}: {scale} | {loss} | {checkpointing} | {offload} | {lever or 'none'} | {planned / MIB:,.1f} "
          f"| {measured / MIB:,.1f} | {ratio:.4f} |", flush=True)
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scales", default=",".join(SCALES), help=f"comma-separated, of {', '.join(SCALES)}")
    names = parser.parse_args().scales.split(",")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    info = init_fake_distributed(2, torch.device("cpu"))
    started = time.perf_counter()
    print("| scale | loss | checkpointing | activation offload | long-row lever | planned peak MiB | measured peak MiB "
          "| ratio |\n| --- | --- | --- | --- | --- | ---: | ---: | ---: |")
    ratios = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                scale = SCALES[name]
                model_dir = scale.write(Path(tmp) / name)
                for choice in itertools.product(LOSSES, CHECKPOINTING, OFFLOAD):
                    ratios.append(row(name, scale, model_dir, choice, info))
                for lever in LONG_ROW_LEVERS:
                    ratios.append(row(name, scale, model_dir, ("chunked", "every layer", "off"), info, lever))
    finally:
        cleanup()
    print(f"\n({time.perf_counter() - started:.0f} s)")
    worst = max(ratios, key=lambda r: abs(r - 1))
    print(f"worst planned/measured peak ratio: {worst:.2f} (of {len(ratios)} configurations)")


if __name__ == "__main__":
    main()
