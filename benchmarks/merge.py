"""Merging an adapter into a ~1B Llama: peak host RAM and time, ours (tensor by tensor) vs the PEFT way.

The peer is what a user would otherwise run: from_pretrained in bf16, PeftModel.from_pretrained,
merge_and_unload, save_pretrained. Ours is scripts/merge_adapter.py's function, once into the dequantized
NF4 weights (the default: what training computed with) and once into the original weights (what the peer
does). Each runs in a fresh process; memory is above that process's baseline (VmHWM and sampled RssAnon).

    python -m benchmarks.merge --out-dir /tmp/bench-merge
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Literal

import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from benchmarks.loading import CONFIG, GB, write_checkpoint
from benchmarks.memory_sampler import AnonPeak, reset_peak_rss
from qlora_fsdp.outputs.metrics import proc_status_bytes

RANK, ALPHA = 16, 32
LINEARS = {"self_attn.q_proj": ("h", "h"), "self_attn.k_proj": ("kv", "h"), "self_attn.v_proj": ("kv", "h"),
           "self_attn.o_proj": ("h", "h"), "mlp.gate_proj": ("f", "h"), "mlp.up_proj": ("f", "h"),
           "mlp.down_proj": ("h", "f")}


def write_adapter(model_dir: Path, out: Path) -> None:
    """A PEFT LoRA adapter (r=16, all linears, B far from zero) plus the training config merge reads."""
    from qlora_fsdp.config import Config, to_yaml
    from qlora_fsdp.loading.adapter import TRAINING_CONFIG

    dims = {"h": CONFIG["hidden_size"], "f": CONFIG["intermediate_size"], "kv": CONFIG["hidden_size"] // 8}
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        for name, (rows, cols) in LINEARS.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, dims[cols], generator=generator) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(dims[rows], RANK, generator=generator) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
              "target_modules": sorted(n.split(".")[-1] for n in LINEARS), "base_model_name_or_path": str(model_dir),
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False}
    (out / "adapter_config.json").write_text(json.dumps(config))
    cfg = Config()
    cfg.model.path = str(model_dir)
    (out / TRAINING_CONFIG).write_text(to_yaml(cfg))


def merge_ours(adapter: Path, out: Path, base_weights: Literal["dequantized", "original"],
               shard_bytes: int) -> None:
    from qlora_fsdp.loading.adapter import config_for_adapter
    from qlora_fsdp.tools.adapter_merge import merge_adapter

    merge_adapter(config_for_adapter(adapter, None, []), adapter, out, "bfloat16", shard_bytes, base_weights)


def merge_peer(adapter: Path, out: Path, model_dir: Path, shard_bytes: int) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.save_pretrained(out, max_shard_size=shard_bytes)


def worker(which: str, model_dir: str, adapter: str, out: str, shard_bytes: int, queue) -> None:
    torch.set_num_threads(2)
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import qlora_fsdp.tools.adapter_merge  # noqa: F401  (same imports on both paths before the baseline)

    baseline, baseline_anon = proc_status_bytes("VmRSS"), proc_status_bytes("RssAnon")
    reset_peak_rss()
    started = time.perf_counter()
    with AnonPeak() as anon:
        if which == "peer (PEFT merge_and_unload)":
            merge_peer(Path(adapter), Path(out), Path(model_dir), shard_bytes)
        else:
            merge_ours(Path(adapter), Path(out), "original" if "original" in which else "dequantized", shard_bytes)
    queue.put((which, proc_status_bytes("VmHWM") - baseline, anon.peak - baseline_anon,
               time.perf_counter() - started))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/bench-merge"))
    parser.add_argument("--max-shard-size", default="500MB", help="output shard size, for both paths")
    args = parser.parse_args()
    from qlora_fsdp.tools.adapter_merge import parse_size

    shard_bytes = parse_size(args.max_shard_size)
    model_dir, adapter = args.out_dir / "model", args.out_dir / "adapter"
    if not (model_dir / "model.safetensors.index.json").is_file():
        write_checkpoint(model_dir)
    write_adapter(model_dir, adapter)
    n_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    ctx = mp.get_context("spawn")
    rows: list[tuple[str, int, int, float]] = []  # what worker puts on its queue
    for which in ("ours, into dequantized NF4 (default)", "ours, into original weights",
                  "peer (PEFT merge_and_unload)"):
        out = args.out_dir / f"merged-{len(rows)}"
        shutil.rmtree(out, ignore_errors=True)
        queue = ctx.Queue()
        proc = ctx.Process(target=worker, args=(which, str(model_dir), str(adapter), str(out), shard_bytes, queue))
        proc.start()
        rows.append(queue.get())
        proc.join()
    print(f"\nmerge of a {n_bytes / GB:.2f} GiB bf16 checkpoint ({CONFIG['num_hidden_layers']} layers), "
          f"LoRA r={RANK} on all linears, bf16 output in shards of {args.max_shard_size}\n")
    print("| path | peak RSS above baseline (GiB) | peak anonymous (GiB) | time (s) |")
    print("| --- | ---: | ---: | ---: |")
    for which, rss, anon, seconds in rows:
        print(f"| {which} | {rss / GB:.2f} | {anon / GB:.2f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
