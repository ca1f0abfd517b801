"""Peak host RAM per rank while loading a ~1B Llama in NF4 on 2 CPU ranks: our streaming loader vs the peer path.

The peer is what a user would otherwise do: every rank calls transformers' from_pretrained with the NF4
BitsAndBytesConfig. Figures are above the process's memory just before loading: peak RSS (VmHWM, reset
then), and peak anonymous memory (RSS without file-backed pages, sampled every 5 ms).

    python scripts/benchmark_loading.py --out-dir /tmp/bench-1b
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from qlora_fsdp.training.metrics import proc_status_bytes  # noqa: E402

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


def reset_peak_rss() -> None:
    """Start the peak (VmHWM) afresh. ru_maxrss cannot be used: a spawned child inherits its parent's peak,
    and the parent held the generated checkpoint (that error put 1.76 GiB on both of our ranks)."""
    Path("/proc/self/clear_refs").write_text("5")


class AnonPeak:
    """Peak of anonymous memory (RSS without file-backed pages such as a memory-mapped checkpoint),
    sampled every 5 ms by a thread: a fairer view of what a load strictly needs."""

    def __init__(self) -> None:
        self.peak, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, proc_status_bytes("RssAnon"))
            time.sleep(0.005)

    def __enter__(self) -> AnonPeak:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, proc_status_bytes("RssAnon"))


def prepare_ours(model_dir: str) -> Callable[[], object]:
    from qlora_fsdp.api import build_model
    from qlora_fsdp.config import Config
    from qlora_fsdp.distributed import init_distributed

    info = init_distributed()
    cfg = Config()
    cfg.model.path = model_dir
    cfg.checkpointing.mode = "off"
    return lambda: build_model(cfg, info)


def prepare_peer(model_dir: str) -> Callable[[], object]:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dist.init_process_group("gloo")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    return lambda: AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, dtype=torch.bfloat16)


def worker(which: str, model_dir: str, rank: int, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import transformers  # noqa: F401

    import qlora_fsdp  # noqa: F401  (same imports for both paths before the baseline)

    load = (prepare_ours if which == "ours" else prepare_peer)(model_dir)
    baseline, baseline_anon = proc_status_bytes("VmRSS"), proc_status_bytes("RssAnon")
    reset_peak_rss()
    with AnonPeak() as anon:
        model = load()  # noqa: F841  (held until the peaks are read)
    queue.put((which, rank, proc_status_bytes("VmHWM") - baseline, anon.peak - baseline_anon))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def measure(which: str, model_dir: Path) -> list[tuple[int, int]]:
    """(peak RSS, peak anonymous memory) above the baseline, per rank."""
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
    return [(peak, anon) for _, _, peak, anon in results]


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
    print("| rank | ours: peak RSS | peer: peak RSS | ratio | ours: peak anonymous | peer: peak anonymous | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rank, ((o_rss, o_anon), (p_rss, p_anon)) in enumerate(zip(ours, peer, strict=True)):
        print(f"| {rank} | {o_rss / GB:.2f} GiB | {p_rss / GB:.2f} GiB | {o_rss / p_rss:.2f} | "
              f"{o_anon / GB:.2f} GiB | {p_anon / GB:.2f} GiB | {o_anon / p_anon:.2f} |")

if __name__ == "__main__":
    main()
