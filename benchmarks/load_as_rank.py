"""Load a model as rank 0 of a fake N-rank world on this machine's one device, and report what that rank holds.

FSDP2 shards (and so allocates and loads) exactly what rank 0 of the real world would, while collectives
do nothing; so one GPU shows one rank's real memory for a model that needs several. With
`model.init=random` only a config.json is needed:

    python -m benchmarks.load_as_rank --recipe tiny_cpu --world-size 2 \\
        model.path=model_configs/llama-3.1-70b model.init=random
"""

from __future__ import annotations

import argparse
import time

import bitsandbytes as bnb
import torch

import qlora_fsdp  # noqa: F401, I001  (first: it quiets a bitsandbytes CPU notice)
from qlora_fsdp.config import load_config
from qlora_fsdp.distributed import cleanup, init_fake_distributed, local_shard
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.measure.real_step import held_quant_state_bytes
from qlora_fsdp.outputs.metrics import proc_status_bytes
from qlora_fsdp.precision import describe_device
from qlora_fsdp.run.description import describe_run

GB = 2**30


def size(n_bytes: float) -> str:
    return f"{n_bytes / GB:.2f} GiB" if n_bytes >= GB / 10 else f"{n_bytes / 2**20:.2f} MiB"


def held_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes this rank holds, by kind."""
    held = {"4-bit base (packed)": 0, "quantization state": 0, "other base weights": 0, "LoRA weights": 0}
    packed_ids = set()
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            packed_ids.add(id(module.weight))
            assert module.quant_state is not None, "a loaded Linear4bit holds its quantization state"
            held["quantization state"] += held_quant_state_bytes(module.quant_state)
    for param in model.parameters():
        local = local_shard(param)
        size = local.numel() * local.element_size()
        kind = "LoRA weights" if param.requires_grad else "other base weights"
        held["4-bit base (packed)" if id(param) in packed_ids else kind] += size
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny_cpu")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    cfg = describe_run(load_config(args.recipe, args.overrides), describe_device(device)).cfg
    info = init_fake_distributed(args.world_size, device)
    baseline_rss, started = proc_status_bytes("VmRSS"), time.perf_counter()
    model = build_sharded_model(cfg, info)
    seconds = time.perf_counter() - started
    rows = [(kind, size(n_bytes)) for kind, n_bytes in held_bytes(model).items()]
    rows.append(("load time", f"{seconds:.0f} s"))
    if device.type == "cuda":
        rows.append(("peak GPU memory allocated", size(torch.cuda.max_memory_allocated())))
        rows.append(("peak GPU memory reserved", size(torch.cuda.max_memory_reserved())))
    rows.append(("host RSS: peak - before loading", size(proc_status_bytes("VmHWM") - baseline_rss)))
    print(f"\n{cfg.model.path} ({cfg.model.init} weights), rank 0 of a fake world of {args.world_size} on {device}\n")
    print("| what rank 0 holds | size |\n| --- | --- |")
    print("\n".join(f"| {name} | {value} |" for name, value in rows))
    cleanup()


if __name__ == "__main__":
    main()
