"""Merge a trained adapter into its base and save a standard Hugging Face checkpoint (safetensors shards).

    qlora-merge --adapter outputs/demo/adapter --out outputs/demo/merged
    python scripts/merge_adapter.py --adapter outputs/demo/adapter --out outputs/demo/merged
    python scripts/merge_adapter.py --adapter ADAPTER --out OUT --dtype float16 --max-shard-size 1GB
    python scripts/merge_adapter.py --adapter ADAPTER --out OUT --recipe llama70b_2x4090 --device cuda

The run's settings come from the adapter folder's training_config.yaml (written by train.py); a PEFT adapter
trained elsewhere needs --recipe. The base is read tensor by tensor and written a shard at a time, so host RAM
peaks near one output shard plus one weight (a 70B merge fits in a few GB).
The result loads with `AutoModelForCausalLM.from_pretrained(OUT)`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from qlora_fsdp.commands.exit import run_command
from qlora_fsdp.errors import UserError


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", type=Path, required=True, help="a PEFT adapter folder (e.g. OUTPUT_DIR/adapter)")
    parser.add_argument("--out", type=Path, required=True, help="new folder for the merged checkpoint")
    parser.add_argument("--recipe", help="the run's recipe, where the adapter has no training_config.yaml")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--max-shard-size", default="2GB",
                        help="largest safetensors file, e.g. 2GB or 500MB; host RAM peaks near one shard")
    parser.add_argument("--base-weights", default="dequantized", choices=["dequantized", "original"],
                        help="dequantized: the 4-bit weights training saw (default); original: the unquantized ones")
    parser.add_argument("--device", default="cpu", help="where to quantize and merge: cpu, or cuda for speed")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.path=/local/copy")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: run(args))


def announce_size(args: argparse.Namespace) -> None:
    """The merged checkpoint's size, before it is written (qlora_fsdp/tools/export_size.py: an estimate from the
    base's config); nothing where the config cannot be built on the meta device."""
    from qlora_fsdp.tools.export_size import in_words, merged_size_bytes

    try:
        size = merged_size_bytes(args.adapter, args.dtype, args.recipe, args.overrides)
    except Exception:  # an estimate only: the merge itself says what is wrong with the base
        return
    print(f"writing about {in_words(size)} ({args.dtype})", flush=True)


def run(args: argparse.Namespace) -> int:
    if args.out.exists() and any(args.out.iterdir()) and not args.overwrite:  # refused before torch is imported
        raise UserError(f"{args.out} exists and is not empty: choose another --out, or pass --overwrite")
    from qlora_fsdp.loading.adapter import config_for_adapter  # PEFT and torch: not for --help or a usage error
    from qlora_fsdp.tools.adapter_merge import merge_adapter, parse_size

    cfg = config_for_adapter(args.adapter, args.recipe, args.overrides)
    announce_size(args)
    started = time.perf_counter()
    shards = merge_adapter(cfg, args.adapter, args.out, args.dtype, parse_size(args.max_shard_size),
                           args.base_weights, args.device)
    print(f"merged {args.adapter} into {cfg.model.path}: {args.out} ({shards} shard{'s' * (shards > 1)}, "
          f"{args.dtype}, {time.perf_counter() - started:.1f} s)")
    return 0
