"""Shared test tools: a tiny local checkpoint, configs for it, and a launcher for N gloo ranks."""

from __future__ import annotations

import io
import math
import os
import sys
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
from torch.distributed.tensor import DTensor

from qlora_fsdp.config import Config
from qlora_fsdp.data.batching import Batch, Sample, collate
from qlora_fsdp.data.pipeline import load_dataset
from qlora_fsdp.tools.tiny_model import TinyModelSpec, write_tiny_model
from qlora_fsdp.torch_versions import fsdp_param_groups, release
from tests.rank_pool import free_port, retire_this_worker, session_pool

# the collectives FSDP2 calls (tests count them): torch 2.13 renamed them
FSDP2_ALL_GATHER, FSDP2_REDUCE_SCATTER = (
    ("all_gather_single", "reduce_scatter_single") if release(torch.__version__) >= (2, 13)
    else ("all_gather_into_tensor", "reduce_scatter_tensor"))

REPO = Path(__file__).resolve().parent.parent


def build_tiny_checkpoint(out: Path, layers: int = 2, max_shard_size: str = "50GB", family: str = "llama") -> Path:
    """A seeded tiny causal LM + tokenizer, saved like a hub checkpoint (seconds on a CPU)."""
    spec = TinyModelSpec(hidden_size=128, layers=layers, family=family)
    write_tiny_model(out, REPO / "data" / "tiny_instruct.jsonl", spec, max_shard_size)
    return out


def transformers_nf4(model_dir: Path, model_class: Any = None, unquantized: list[str] | None = None,
                     **settings: Any) -> torch.nn.Module:
    """transformers + bitsandbytes' own NF4 load (double quantization, fp32 compute), none of our loading code: the
    reference our loaded model is held to. Eager attention where transformers' sdpa cannot run the family.
    `unquantized`: bitsandbytes' skip list (llm_int8_skip_modules) instead of transformers' own choice; `settings`:
    more of from_pretrained's arguments (num_labels)."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.uint8,
                               llm_int8_skip_modules=unquantized)
    model_class = model_class or AutoModelForCausalLM
    try:
        model = model_class.from_pretrained(model_dir, quantization_config=quant, dtype=torch.float32, **settings)
    except ValueError:  # Gemma 2 (soft-capping), gpt-oss (sinks): sdpa is refused
        model = model_class.from_pretrained(model_dir, quantization_config=quant, dtype=torch.float32,
                                            attn_implementation="eager", **settings)
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


def rank_units(n_units: int, cfg: Config, rank: int, world_size: int) -> list[int]:
    """The units a rank takes of the first `n_units`: its share, or with rows split over the ranks
    (fsdp.context_parallel) its split's share (each rank then holds its part of every micro-batch: split_parts)."""
    degree = cfg.fsdp.context_parallel
    return list(range(n_units))[rank // degree :: world_size // degree]


def split_parts(batches: list[Batch], cfg: Config, rank: int, pad_id: int) -> list[Batch]:
    """This rank's part of each (packed) micro-batch under fsdp.context_parallel; the batches themselves without."""
    from qlora_fsdp.objectives.row_shards import shard_row

    degree = cfg.fsdp.context_parallel
    return [shard_row(b, degree, rank % degree, pad_id) for b in batches] if degree > 1 else batches


def variable_length_samples(cfg: Config, n: int) -> list[Sample]:
    """n training samples of clearly different lengths (and target counts)."""
    from qlora_fsdp.loading.checkpoint import load_tokenizer

    data = load_dataset(load_tokenizer(cfg), cfg.data, seed=0)
    samples = data.samples(data.train, list(range(min(200, len(data.train)))))
    samples = sorted(samples[:200], key=lambda s: len(s.input_ids))
    picked = [samples[round(i * (len(samples) - 1) / (n - 1))] for i in range(n)]
    assert len({len(s.input_ids) for s in picked}) > n // 2, "samples should vary in length"
    return picked


def batches(samples: list[Sample], size: int, pad_id: int):
    return [collate(samples[i : i + size], pad_id) for i in range(0, len(samples), size)]


@torch.no_grad()
def add_whole(param: torch.Tensor, step: torch.Tensor) -> None:
    """Add a whole tensor to a parameter, sharded or not: each rank adds its rows (the loader's placement)."""
    from qlora_fsdp.distributed import local_shard
    from qlora_fsdp.loading.placement import shard_row_range

    first, last = shard_row_range(param, step.shape[0])
    local_shard(param).add_(step[first:last].to(param.dtype))


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded LoRA gradients by clean name (a collective under FSDP: every rank calls it)."""
    from qlora_fsdp.loading.names import clean_name

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
            for group in fsdp_param_groups(module._get_fsdp_state()) for fsdp_param in group.fsdp_params]


def decoder_lora_keys(model: torch.nn.Module) -> set[str]:
    """PEFT's adapter-file keys of LoRA A and B on every 4-bit linear in the decoder layers of transformers' own 4-bit
    model: what lora.target_modules 'all-linear' trains, known without our code. Two gradient dicts compared key
    for key also agree when both are empty; this says which keys they must hold."""
    import bitsandbytes as bnb

    return {f"base_model.model.{name}.lora_{part}.weight" for name, module in model.named_modules()
            if isinstance(module, bnb.nn.Linear4bit) and ".layers." in name
            and not any(tower in name for tower in ("vision_tower", "vision_model", "visual"))
            for part in "AB"}


def reference_loss(model: torch.nn.Module, samples: list[Sample]) -> tuple[torch.Tensor, int]:
    """The summed cross-entropy of the samples' target tokens under a transformers (or PEFT) model, and how many
    targets there are: one forward of the samples right-padded into a batch, the padding masked out. Each sample's
    logits are those of its own forward to float rounding (1e-7 relative), and each 4-bit weight is dequantized
    once instead of once a sample (bitsandbytes dequantizes a whole weight per call on the CPU: a pre-quantized
    SmolLM2's 16 held-out samples one by one took 7x as long)."""
    length = max(len(sample.input_ids) for sample in samples)
    ids = torch.tensor([sample.input_ids + [0] * (length - len(sample.input_ids)) for sample in samples])
    mask = torch.tensor([[1] * len(sample.input_ids) + [0] * (length - len(sample.input_ids)) for sample in samples])
    labels = torch.tensor([sample.labels + [-100] * (length - len(sample.labels)) for sample in samples])[:, 1:]
    logits = model(input_ids=ids, attention_mask=mask).logits
    # row by row: one row's log-softmax at a time (a 262k vocabulary's logits are large)
    total = sum(torch.nn.functional.cross_entropy(row[:-1], targets, ignore_index=-100, reduction="sum")
                for row, targets in zip(logits, labels, strict=True))
    return total, int((labels != -100).sum())


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference of any one tensor, so a wrong small tensor cannot hide behind the large
    ones (as in one global norm). A tensor whose reference is zero or nearly (LoRA A's gradient while B is zero) is
    measured against a thousandth of the typical tensor's norm instead of its own."""
    assert a.keys() == b.keys() and a
    norms = {k: float(b[k].double().norm()) for k in b}
    floor = 1e-3 * (sum(n * n for n in norms.values()) / len(norms)) ** 0.5
    return max(float((a[k].double() - b[k].double()).norm()) / max(norms[k], floor, 1e-30) for k in a)


def fp32_reordering_bound(n: int) -> float:
    """The relative difference (relative_difference, pytest.approx's rel) allowed between two float32 computations
    of the same numbers that differ only in the order of their sums, n the longest sum behind them (a step's
    gradients and loss: its tokens).

    Tiles, chunks, packed rows, shards and micro-batches change the matmuls' shapes, and with them how the CPU's
    kernels block and sum (an AMX / AVX512-BF16 CPU blocks otherwise than an AVX2 one): no fixed bound such as 1e-6
    holds on every CPU (a step in 5-token tiles moved its gradients 4.5e-7 on an AMD EPYC, 2.0e-6 on an AMX CPU;
    789 tokens, 0.6 sqrt(n) eps). The rounding errors of a sum of n terms add up like a random walk, about
    sqrt(n) eps relative (the worst case, n eps, no kernel comes near); 4 times that leaves room for the sums in
    series (forward, backward, the layers). The bugs these comparisons guard (a dropped tile or chunk, a wrong
    offset, a missing term) move the numbers by 1e-4 (a loss) and far more."""
    return 4 * math.sqrt(n) * torch.finfo(torch.float32).eps


def assert_close_to_summation_order(actual: torch.Tensor, expected: torch.Tensor, n: int,
                                    rtol: float = 1e-5) -> None:
    """Element by element, float32 tensors that may differ only in the order of sums of n terms: an entry near zero
    came from terms as large as the tensor's largest entries, so its rounding is the bound times that scale (an
    absolute tolerance), not times its own size."""
    atol = fp32_reordering_bound(n) * float(expected.detach().abs().max())
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


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
    """Run fn(info, *args) on `world_size` gloo ranks of the session's pool (tests/rank_pool.py: workers that
    imported everything once); return each rank's result.

    With fake=True, one process acts as rank 0 of a fake world of `world_size` (collectives do nothing)."""
    out_dir = Path(tmp_dir) / f"ranks_{fn.__name__}_{free_port()}"
    out_dir.mkdir(parents=True)
    return session_pool().run(fn, world_size, args, out_dir, fake, timeout)


@dataclass
class CliResult:
    """What `python train.py ...` would have returned and printed, from a call of its main in this process or a
    pool rank."""

    returncode: int
    stdout: str
    stderr: str


class _RankExit(BaseException):
    def __init__(self, code: int) -> None:
        self.code = code


def _raise_rank_exit(code: int) -> NoReturn:
    raise _RankExit(code)


def cli_in_rank(info: Any, argv: list[str], faults: tuple[tuple[str, tuple], ...] = ()) -> CliResult:
    """train.py's main in this rank, with tests/fault_run.py's injections named in `faults` ((name, args) pairs,
    built here, in the rank's process) and undone after.

    A rank that ends a multi-rank run with a user error leaves the process at once (rank_errors.exit_now); here
    that exit becomes the result's code, and the worker, whose process group is left as such a rank leaves it,
    is retired after this task."""
    import qlora_fsdp.distributed.rank_errors as rank_errors
    from tests import fault_run

    out, err = io.StringIO(), io.StringIO()
    injections = [getattr(fault_run, name)(*args) for name, args in faults]
    injections.append(fault_run.patches((rank_errors, "exit_now", _raise_rank_exit)))
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = fault_run.main_with_faults(argv, *injections)
        except _RankExit as exit_:
            code = exit_.code
            retire_this_worker()
    return CliResult(code, out.getvalue(), err.getvalue())


def run_cli(argv: list[str], world_size: int, tmp_dir: Path,
            faults: tuple[tuple[str, tuple], ...] = ()) -> list[CliResult]:
    """`torchrun --nproc_per_node world_size train.py argv...` without torchrun: the same main on pool ranks."""
    return run_ranks(cli_in_rank, world_size, [str(a) for a in argv], faults, tmp_dir=tmp_dir)


def train_here(argv: list[str]) -> CliResult:
    """`python train.py argv...` run in this process (train.py is that one call; test_end_to_end runs the file)."""
    from qlora_fsdp.commands.train import main

    return command_here(main, argv)


def command_here(main: Callable[[list[str]], int], argv: list[str], stdin: str | None = None) -> CliResult:
    """A command's main (qlora_fsdp.commands) run in this process as its console entry point would run it."""
    out, err, environ, real_stdin = io.StringIO(), io.StringIO(), dict(os.environ), sys.stdin
    with redirect_stdout(out), redirect_stderr(err):
        try:
            if stdin is not None:
                sys.stdin = io.StringIO(stdin)
            code = main([str(a) for a in argv])
        except SystemExit as exit_:  # argparse's own errors and --help
            code = exit_.code if isinstance(exit_.code, int) else 1
        finally:  # a world of one sets RANK, WORLD_SIZE, MASTER_PORT: not for the tests that follow
            sys.stdin = real_stdin
            os.environ.clear()
            os.environ.update(environ)
    return CliResult(code, out.getvalue(), err.getvalue())


def recipe_pair_loss(cfg: Config, device: torch.device) -> Any:
    """The recipe's pair loss (its preference objective's, objectives/preference.py) over the recipe's forward."""
    from qlora_fsdp.losses.forward import ForwardLoss
    from qlora_fsdp.objectives.table import objective_class

    return cast(Any, objective_class(cfg)).LOSS.with_forward(cfg, ForwardLoss.for_config(cfg, device))


def shortened_checkpoint(source: Path, out: Path, layers: int) -> Path:
    """`source`'s first `layers` decoder layers as a checkpoint folder of its own: the real weights, tokenizer and
    template of a real model, at the cost of a few layers. For checks of numbers (ours against transformers, a
    GGUF against its source) that every layer repeats the same way; not for what the whole model knows."""
    import json
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy2(path, out / path.name)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    kept = {name: tensor for name, tensor in load_file(source / "model.safetensors").items()
            if not (found := re.search(r"\.layers\.(\d+)\.", name)) or int(found.group(1)) < layers}
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    return out


def head_of(name: str, lines: int, folder: Path) -> Path:
    """The first `lines` records of a shipped data file, written to `folder` under its own name (a small file: a run's
    pipeline reads it whole, a precomputed reference passes over every record)."""
    out = folder / name
    out.write_text("".join((REPO / "data" / name).read_text().splitlines(keepends=True)[:lines]))
    return out


def generation_plan(**settings: Any) -> Any:
    """A GenerationPlan for direct decoding calls (objectives/rollouts.py's generate): the `generation` section's
    settings, for one prompt."""
    from qlora_fsdp.config import GenerationConfig
    from qlora_fsdp.generation.plan import GenerationPlan

    return GenerationPlan(GenerationConfig(**settings), prompts=1, prompt_tokens=0)
