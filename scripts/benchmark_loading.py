"""Peak host RAM per rank while loading a ~1B Llama in NF4 on 2 CPU ranks: our streaming loader vs the peer path.

The peer is what a user would otherwise do: every rank calls transformers' from_pretrained with the NF4
BitsAndBytesConfig. Figures are peak RSS (ru_maxrss) minus the process's RSS just before loading.

    python scripts/benchmark_loading.py --out-dir /tmp/bench-1b
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
from pathlib import Path

import psutil
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GB = 2**30
CONFIG = {  # a TinyLlama-like shape, 16 layers: about 1.0B parameters
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 4,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2,
}


def layer_tensors(i: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    h, f, kv = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["hidden_size"] // 8
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
    out = {f"model.layers.{i}.{n}.weight": randn(s, generator) for n, s in shapes.items()}
    out[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    out[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return out


def randn(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)


def write_checkpoint(out: Path) -> tuple[int, int]:
    """Several safetensors shards plus an index, written a few layers at a time; returns (params, two largest)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIG))
    generator = torch.Generator().manual_seed(0)
    v, h = CONFIG["vocab_size"], CONFIG["hidden_size"]
    groups = [{"model.embed_tokens.weight": randn((v, h), generator)}]
    groups += [{k: t for i in range(start, start + 4) for k, t in layer_tensors(i, generator).items()}
               for start in range(0, CONFIG["num_hidden_layers"], 4)]
    head = randn((v, h), generator)
    groups.append({"model.norm.weight": torch.ones(h, dtype=torch.bfloat16), "lm_head.weight": head})
    weight_map, n_params, sizes = {}, 0, []
    for index, group in enumerate(groups):
        name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, out / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in group})
        n_params += sum(t.numel() for t in group.values())
        sizes += [t.numel() * 2 for t in group.values()]
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return n_params, sum(sorted(sizes)[-2:])


def rss() -> int:
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_ours(model_dir: str):
    from qlora_fsdp.api import build_model
    from qlora_fsdp.config import Config
    from qlora_fsdp.distributed import init_distributed

    info = init_distributed()
    cfg = Config()
    cfg.model.path = model_dir
    cfg.checkpointing.mode = "off"
    baseline = rss()
    model = build_model(cfg, info)
    return baseline, model


def load_peer(model_dir: str):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dist.init_process_group("gloo")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    baseline = rss()
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, dtype=torch.bfloat16)
    return baseline, model


def worker(which: str, model_dir: str, rank: int, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import transformers  # noqa: F401

    import qlora_fsdp  # noqa: F401  (same imports for both paths before the baseline)

    baseline, model = (load_ours if which == "ours" else load_peer)(model_dir)
    queue.put((which, rank, baseline, peak_rss()))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def measure(which: str, model_dir: Path) -> list[tuple[int, int]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(which, str(model_dir), r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return [(baseline, peak) for _, _, baseline, peak in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/bench-1b"))
    args = parser.parse_args()
    n_params, two_largest = write_checkpoint(args.out_dir)
    linear = n_params - 2 * CONFIG["vocab_size"] * CONFIG["hidden_size"]
    nf4_bytes = linear * 0.5 * (1 + 0.127 / 4) + (n_params - linear) * 2  # packed + double-quant state + bf16 rest
    budget = (nf4_bytes / 2 + two_largest) * 1.10
    ours, peer = measure("ours", args.out_dir), measure("peer", args.out_dir)
    n_shards = len(list(args.out_dir.glob("*.safetensors")))
    print(f"\n{n_params / 1e9:.2f}B-parameter Llama, {n_shards} safetensors shards, "
          f"2 CPU ranks; NF4 model {nf4_bytes / GB:.2f} GiB; budget per rank {budget / GB:.2f} GiB "
          "(NF4/2 + two largest bf16 tensors + 10%)\n")
    print("| rank | ours: peak - baseline (GiB) | peer: peak - baseline (GiB) | ours / peer |")
    print("| --- | --- | --- | --- |")
    for rank, ((ob, op), (pb, pp)) in enumerate(zip(ours, peer, strict=True)):
        print(f"| {rank} | {(op - ob) / GB:.2f} | {(pp - pb) / GB:.2f} | {(op - ob) / (pp - pb):.2f} |")


if __name__ == "__main__":
    main()
