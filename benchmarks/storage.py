"""Packed 4-bit storage: uint8 (ours) against the old bf16, step time per rank under FSDP2, offload off and on.

One process acts as rank 0 of a fake 2-rank world (the all-gather itself does nothing), so what differs between
the rows is exactly what the storage changes: the copy into and out of the gather buffers and the 4-bit kernels.
The model is the Llama architecture at a small size with seeded random weights; bf16 base, LoRA and compute
policy (the setting in which a layer's all-gather was uniformly bf16 under the old storage).

    python -m benchmarks.storage            # about a minute on 2 CPU cores; uses CUDA when present
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import TypedDict

import torch

import qlora_fsdp.loading.build
from qlora_fsdp.config import load_config
from qlora_fsdp.data.batching import Sample, collate
from qlora_fsdp.distributed import DistInfo, cleanup, init_fake_distributed
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.losses.forward import loss_sum

REPO = Path(__file__).resolve().parent.parent

VOCAB_SIZE = 8192
ARCHITECTURE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
                "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 16,
                "num_key_value_heads": 4, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 1024,
                "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


class Row(TypedDict):
    storage: str
    offload: bool
    median_s: float


def step_times(model_dir: Path, storage: torch.dtype, offload: bool, info: DistInfo, steps: int,
               tokens: int) -> list[float]:
    cfg = load_config("tiny_cpu", [f"model.path={model_dir}", "model.init=random", "model.dtype=bfloat16",
                                   "quant.compute_dtype=bfloat16", "lora.dtype=bfloat16",
                                   "fsdp.param_dtype=bfloat16", f"fsdp.cpu_offload={str(offload).lower()}"])
    qlora_fsdp.loading.build.QUANT_STORAGE = storage  # loading follows the dtype the model was built with
    model = build_sharded_model(cfg, info)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, VOCAB_SIZE, (tokens,), generator=generator).tolist()
    batch = collate([Sample(ids, ids)], pad_id=0)
    times = []
    for _ in range(steps + 2):  # two warm-up steps
        started = time.perf_counter()
        loss_sum(model, batch, info.device).backward()
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times[2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    info = init_fake_distributed(2, device)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(ARCHITECTURE))
        for offload in (False, True):
            for name, storage in (("uint8 (ours)", torch.uint8), ("bf16 (old)", torch.bfloat16)):
                times = step_times(model_dir, storage, offload, info, args.steps, args.tokens)
                rows.append({"storage": name, "offload": offload, "median_s": statistics.median(times)})
    cleanup()
    print(f"\nrank 0 of a fake 2-rank world on {device}; {args.tokens} tokens a step, median of {args.steps}\n")
    print("| storage | cpu_offload | step (s) | vs uint8 |\n| --- | --- | ---: | ---: |")
    for row in rows:
        reference = next(r for r in rows if r["offload"] == row["offload"] and r["storage"].startswith("uint8"))
        print(f"| {row['storage']} | {row['offload']} | {row['median_s']:.3f} | "
              f"{row['median_s'] / reference['median_s']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
