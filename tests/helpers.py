"""Shared test tools: a tiny local checkpoint, configs for it, and a launcher for N gloo ranks."""

from __future__ import annotations

import gc
import os
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from qlora_fsdp.config import Config
from qlora_fsdp.data.batching import Sample, collate
from qlora_fsdp.data.pipeline import load_dataset
from qlora_fsdp.distributed import cleanup, init_distributed, init_fake_distributed
from qlora_fsdp.tools.tiny_model import TinyModelSpec, write_tiny_model

REPO = Path(__file__).resolve().parent.parent


def build_tiny_checkpoint(out: Path, layers: int = 2, max_shard_size: str = "50GB", family: str = "llama") -> Path:
    """A seeded tiny causal LM + tokenizer, saved like a hub checkpoint (seconds on a CPU)."""
    spec = TinyModelSpec(hidden_size=128, layers=layers, family=family)
    write_tiny_model(out, REPO / "data" / "tiny_instruct.jsonl", spec, max_shard_size)
    return out


def transformers_nf4(model_dir: Path) -> torch.nn.Module:
    """transformers + bitsandbytes' own NF4 load (double quantization, fp32 compute), none of our loading code: the
    reference our loaded model is held to."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.uint8)
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False  # the kernel training uses (DESIGN.md, CPU eval trap)
    return model.eval()


def tiny_config(model_dir: Path, **sections: dict[str, Any]) -> Config:
    """Config for the tiny checkpoint with fp32 compute, so exactness checks are not bf16 rounding checks."""
    cfg = Config()
    cfg.model.path = str(model_dir)
    cfg.model.dtype = "float32"
    cfg.quant.compute_dtype = "float32"
    cfg.data.path = str(REPO / "data" / "tiny_instruct.jsonl")
    cfg.data.eval_samples = 16
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


def variable_length_samples(cfg: Config, n: int) -> list[Sample]:
    """n training samples of clearly different lengths (and target counts)."""
    from qlora_fsdp.model.build import load_tokenizer

    data = load_dataset(load_tokenizer(cfg), cfg.data, seed=0)
    samples = data.samples(data.train, list(range(min(200, len(data.train)))))
    samples = sorted(samples[:200], key=lambda s: len(s.input_ids))
    picked = [samples[round(i * (len(samples) - 1) / (n - 1))] for i in range(n)]
    assert len({len(s.input_ids) for s in picked}) > n // 2, "samples should vary in length"
    return picked


def batches(samples: list[Sample], size: int, pad_id: int):
    return [collate(samples[i : i + size], pad_id) for i in range(0, len(samples), size)]


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded LoRA gradients by clean name (a collective under FSDP: every rank calls it)."""
    from qlora_fsdp.model.names import clean_name

    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad and param.grad is not None:
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            out[clean_name(name)] = grad.detach().cpu().clone()
    return out


def fsdp_params(model: torch.nn.Module) -> list[Any]:
    """FSDP2's private per-parameter records (offload flag, unsharded gradients): what tests look inside."""
    from torch.distributed.fsdp import FSDPModule

    return [fsdp_param for module in model.modules() if isinstance(module, FSDPModule)
            for fsdp_param in module._get_fsdp_state()._fsdp_param_group.fsdp_params]


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    diff = sum((a[k].double() - b[k].double()).pow(2).sum() for k in a) ** 0.5
    ref = sum(b[k].double().pow(2).sum() for k in b) ** 0.5
    return float(diff / ref)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, out_dir: str, args: tuple, fake: bool) -> None:
    """One rank: run fn, save its result, tear down in step with the other ranks, and leave without interpreter
    finalization.

    A rank once aborted after its work with "terminate called without an active exception" (both ranks, one run
    in many; not reproduced in 40 reruns under load). libstdc++ prints that when std::terminate runs with no
    exception in flight: a joinable std::thread destroyed, or a C++ thread force-unwound because it took the GIL
    after Python began finalizing (torch's destroy_process_group guards one such case). So: models and hooks are
    freed while Python is whole, ranks destroy the group together, and the process ends with os._exit once its
    result file is written, so no C++ destructor runs against a finalizing interpreter."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    code = 1
    try:
        info = init_fake_distributed(world_size, torch.device("cpu")) if fake else init_distributed()
        result = fn(info, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        del result
        gc.collect()
        code = 0
        if not fake:
            _barrier_before_teardown()
    except BaseException:
        traceback.print_exc()
    finally:
        cleanup()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _barrier_before_teardown() -> None:
    """No rank destroys the group while another still uses it; best effort, since some tests make the ranks
    part ways on purpose (a timeout test leaves one rank behind) and their results are already written."""
    try:
        dist.barrier()
    except RuntimeError:
        pass


def _in_sequence(info: Any, calls: list[tuple[Callable, tuple]]) -> list[Any]:
    return [fn(info, *args) for fn, args in calls]


def run_ranks_sequence(calls: list[tuple[Callable, tuple]], world_size: int, tmp_dir: Path,
                       all_ranks: bool = False) -> list[Any]:
    """Rank 0's results (or, with all_ranks, every rank's list) of several fn(info, *args) calls made one after
    another in the same ranks: one process start-up instead of one per call (each builds its own model)."""
    results = run_ranks(_in_sequence, world_size, calls, tmp_dir=tmp_dir)
    return results if all_ranks else results[0]


def run_ranks(
    fn: Callable, world_size: int, *args: Any, tmp_dir: Path, timeout: float = 300, fake: bool = False
) -> list[Any]:
    """Run fn(info, *args) on `world_size` fresh gloo ranks; return each rank's result.

    With fake=True, one process acts as rank 0 of a fake world of `world_size` (collectives do nothing)."""
    ctx = mp.get_context("spawn")
    out_dir = Path(tmp_dir) / f"ranks_{fn.__name__}_{_free_port()}"
    out_dir.mkdir(parents=True)
    port = _free_port()
    n_procs = 1 if fake else world_size
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, str(out_dir), args, fake))
             for r in range(n_procs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * n_procs, f"rank exit codes {codes}"
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(n_procs)]

