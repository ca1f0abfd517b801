"""Peak host RAM per rank while loading a ~1B Llama in NF4 on 2 CPU ranks: our streaming loader, with each
safetensors reader, against the peer path.

Readers (`qlora_fsdp.loading.weight_files`): `mmap` is safetensors' `safe_open(..., backend="mmap")` (the
library's default, and the loader's: tensors are views of the mapped file), `pread` the same library reading
each tensor (or row range) into a fresh buffer with pread(2), as the header parser it replaced did. The peer is
what a user would otherwise do: every rank calls transformers' from_pretrained with the NF4 BitsAndBytesConfig.

Figures are above the process's memory just before loading. Peak anonymous memory (RssAnon: heap and
tensors, without file-backed pages such as a mapped checkpoint, which the kernel can drop at will) is what a
load strictly needs; the kernel keeps no peak of it, so a thread samples /proc/self/status every millisecond.
Peak RSS is exact (VmHWM, reset just before loading); it adds the mapped checkpoint pages. Where a reader maps
nothing, the two agree, which checks that the sampling misses no spike.

    python -m benchmarks.loading --out-dir /tmp/bench-1b --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from benchmarks.memory_sampler import AnonPeak, reset_peak_rss
from qlora_fsdp.loading.weight_files import Backend
from qlora_fsdp.outputs.metrics import proc_status_bytes

GB, MB = 2**30, 2**20
Loader = Literal["mmap", "pread", "peer"]  # our loader with each safetensors reader, then the peer
LOADERS: tuple[Loader, ...] = get_args(Loader)
CONFIG: dict[str, Any] = {  # a TinyLlama-like shape, 16 layers: about 1.0B parameters (config.json)
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


def prepare_ours(model_dir: str, reader: Backend) -> Callable[[], object]:
    from qlora_fsdp.config import Config
    from qlora_fsdp.distributed import init_distributed
    from qlora_fsdp.loading import reader as loading_reader
    from qlora_fsdp.loading import weight_files
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.precision import describe_device
    from qlora_fsdp.run.description import describe_run

    # training has one reader; only this benchmark swaps in another, in its own process
    loading_reader.stored_weight_tensors = functools.partial(weight_files.stored_weight_tensors, backend=reader)
    info = init_distributed()
    cfg = Config()
    cfg.model.path = model_dir
    cfg.activation_checkpointing.mode = "off"
    cfg = describe_run(cfg, describe_device(info.device)).cfg
    return lambda: build_sharded_model(cfg, info)


def prepare_peer(model_dir: str) -> Callable[[], object]:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dist.init_process_group("gloo")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    return lambda: AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, dtype=torch.bfloat16)


@dataclass
class Peaks:
    """One rank's load: bytes above the baseline, and seconds."""

    anon: int
    rss: int
    seconds: float


def worker(which: Loader, model_dir: str, rank: int, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import transformers  # noqa: F401

    import qlora_fsdp  # noqa: F401  (same imports for every loader before the baseline)

    load = prepare_peer(model_dir) if which == "peer" else prepare_ours(model_dir, which)
    baseline, baseline_anon = proc_status_bytes("VmRSS"), proc_status_bytes("RssAnon")
    reset_peak_rss()
    started = time.perf_counter()
    with AnonPeak() as anon:
        model = load()  # noqa: F841  (held until the peaks are read)
    seconds = time.perf_counter() - started
    queue.put((rank, Peaks(anon.peak - baseline_anon, proc_status_bytes("VmHWM") - baseline, seconds)))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def measure(which: Loader, model_dir: Path) -> list[Peaks]:
    """Both ranks of one load, in fresh processes (a process's peak and allocator state are its own)."""
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
    return [peaks for _, peaks in results]


def spread(values: Sequence[float], scale: float, unit: str) -> str:
    """Median, and the range where there were several runs."""
    digits = 0 if unit == " MiB" else 1  # MiB: the readers differ by tens of them
    text = f"{statistics.median(values) / scale:.{digits}f}{unit}"
    return text if len(values) == 1 else f"{text} ({min(values) / scale:.{digits}f}-{max(values) / scale:.{digits}f})"


def print_table(runs: dict[Loader, list[list[Peaks]]]) -> None:
    """One row per loader and rank; ratios are medians against the peer's (1.00 where it was not run)."""
    print("| loader | rank | peak anonymous | peak RSS | wall time | anonymous / peer | RSS / peer |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for which, repeats in runs.items():
        for rank in range(2):
            own = [r[rank] for r in repeats]
            peer = [r[rank] for r in runs.get("peer", repeats)]
            anon, rss = [p.anon for p in own], [p.rss for p in own]
            ratio_anon = statistics.median(anon) / statistics.median([p.anon for p in peer])
            ratio_rss = statistics.median(rss) / statistics.median([p.rss for p in peer])
            print(f"| {which} | {rank} | {spread(anon, MB, ' MiB')} | {spread(rss, MB, ' MiB')} | "
                  f"{spread([p.seconds for p in own], 1, ' s')} | {ratio_anon:.2f} | {ratio_rss:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/bench-1b"))
    parser.add_argument("--repeats", type=int, default=1, help="runs of every loader, interleaved")
    parser.add_argument("--loaders", default=",".join(LOADERS), help=f"a subset of {','.join(LOADERS)}")
    args = parser.parse_args()
    n_params, two_largest = write_checkpoint(args.out_dir)
    linear = n_params - 2 * CONFIG["vocab_size"] * CONFIG["hidden_size"]
    nf4_bytes = linear * 0.5 * (1 + 0.127 / 4) + (n_params - linear) * 2  # packed + double-quant state + bf16 rest
    budget = (nf4_bytes / 2 + two_largest) * 1.10
    loaders = [which for which in LOADERS if which in args.loaders.split(",")]
    runs: dict[Loader, list[list[Peaks]]] = {which: [] for which in loaders}
    for _ in range(args.repeats):  # interleaved, so a slower spell of a shared machine hits every loader
        for which in loaders:
            runs[which].append(measure(which, args.out_dir))
    n_shards = len(list(args.out_dir.glob("*.safetensors")))
    print(f"\n{n_params / 1e9:.2f}B-parameter Llama, {n_shards} safetensors shards, "
          f"2 CPU ranks, {args.repeats} run(s) each: median (range); NF4 model {nf4_bytes / GB:.2f} GiB; "
          f"budget per rank {budget / GB:.2f} GiB (NF4/2 + two largest bf16 tensors + 10%)\n")
    print_table(runs)


if __name__ == "__main__":
    main()
