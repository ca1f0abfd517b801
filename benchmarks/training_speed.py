"""Useful (non-padding) tokens/s of train.py against the Hugging Face Trainer + PEFT, on long-tailed data.

The same work for every run: the same records (seeded, long-tailed lengths: benchmarks/bench_data.py), one
epoch, the same number of optimizer steps and on average the same samples per step, the same NF4 model (a
26M-parameter Llama built here, large enough that time goes to tokens), LoRA, schedule, optimizer,
checkpointing and context length (1,024), one process each with the same threads. The final held-out loss
of every run is measured by the same code on the same held-out records.

Runs:
- peer: `Trainer` with `get_peft_model`, 8 samples a micro-batch padded to the longest (its defaults), 2
  accumulation steps (4)
- peer, grouped: the same with length-grouped batches (`train_sampling_strategy="group_by_length"`, which
  was `group_by_length=True` before transformers 5)
- train.py: packed rows, as many per step as carry the peer's samples per step on average; its default
  attention (`auto`: each sample attends within itself, no mask)
- train.py with its LoRA matmuls in fp32 (`lora.compute_dtype=weights`), and with PEFT's own LoRA forward
  (`lora.fuse_projections=false` too: each of q/k/v and gate/up casts its input and runs its own A matmul)
- with `--runs`: train.py with compiled decoder layers (`ours_compiled`, compile time included) beside the
  Trainer's `torch_compile=True` (`peer_compiled`); `ours_dense`: `model.attn_implementation=sdpa` (a
  block-diagonal mask over the row)

Each run is repeated `--rounds` times, the runs alternating within a round (the machine drifts by 10%), and
the table shows each run's median by time. `--model real` runs SmolLM2-135M-Instruct (the real model the tests
use, scripts/make_real_model.py) in float32 instead of the 26.7M-parameter one in bf16.

    python -m benchmarks.training_speed                         # about 65 minutes on 2 cores
    python -m benchmarks.training_speed --model real --records 64 --eval-records 50 --runs peer,peer_grouped,ours
                                                                # 2 steps: about 90 minutes
    python -m benchmarks.training_speed --device cuda --arch model_configs/llama-3.1-8b/config.json --layers 8 \
        --context 2048 --runs peer,ours --rounds 1        # one GPU at Llama 3.1 8B's shapes (the GPU check's)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_data import generate, write
from benchmarks.memory_sampler import peak_rss_gib
from qlora_fsdp.tools.tiny_model import TinyModelSpec, write_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
CONTEXT = 1024
PEER_MICRO_BATCH, PEER_ACCUM = 8, 4  # the Trainer's default micro-batch, four a step (32 samples: 7 packed rows)
MAX_TOKENS_PER_CALL = 8192  # train.py: packed rows per micro-batch up to this many tokens
SETTINGS: dict[str, Any] = {"lr": 2e-3, "warmup_steps": 3, "r": 16, "alpha": 32, "seed": 42}
MODEL = TinyModelSpec(hidden_size=512, layers=8, intermediate_size=1408, attention_heads=8, kv_heads=2,
                      init_std=0.05, vocab_size=4096)
RUNS = {"peer": "HF Trainer + PEFT (peer, padded)", "peer_grouped": "HF Trainer + PEFT, group_by_length",
        "peer_compiled": "HF Trainer + PEFT, group_by_length, `torch_compile=True`",
        "ours": "train.py: packed, per-sample attention, fused LoRA projections in the activations' dtype (its "
                "defaults)",
        "ours_fp32_lora": "train.py: the same, LoRA matmuls in fp32 (`lora.compute_dtype=weights`)",
        "ours_peft_lora": "train.py: the same, PEFT's LoRA forward (unfused, fp32: `lora.fuse_projections=false`, "
                          "`lora.compute_dtype=weights`)",
        "ours_compiled": "train.py: the same, `train.compile=true`", "ours_dense": "train.py: packed, dense mask"}
OUR_DEFAULTS = ["model.attn_implementation=auto", "train.compile=false"]
OUR_SETTINGS = {"ours": OUR_DEFAULTS, "ours_fp32_lora": [*OUR_DEFAULTS, "lora.compute_dtype=weights"],
                "ours_peft_lora": [*OUR_DEFAULTS, "lora.fuse_projections=false", "lora.compute_dtype=weights"],
                "ours_compiled": ["model.attn_implementation=auto", "train.compile=true"],
                "ours_dense": ["model.attn_implementation=sdpa", "train.compile=false"]}
DEFAULT_RUNS = "peer,peer_grouped,ours,ours_fp32_lora,ours_peft_lora"
REAL_MODEL = REPO / "models" / "smollm2-135m-instruct"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the runs share: data, model, and the step arithmetic."""

    train: Path
    held_out: Path
    model: Path
    steps: int
    rows_per_micro_batch: int
    accum_steps: int
    dtype: str = "bfloat16"  # of the model and its compute, for every run
    warmup_steps: int = SETTINGS["warmup_steps"]
    context: int = CONTEXT
    device: str = "cpu"  # where every run trains: cpu, or cuda (the GPU check's one-GPU speed)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        fields = json.loads(text)
        return cls(Path(fields["train"]), Path(fields["held_out"]), Path(fields["model"]), int(fields["steps"]),
                   int(fields["rows_per_micro_batch"]), int(fields["accum_steps"]), fields["dtype"],
                   int(fields.get("warmup_steps", SETTINGS["warmup_steps"])), int(fields.get("context", CONTEXT)),
                   fields.get("device", "cpu"))


def token_lengths(model: Path, data_file: Path, context: int = CONTEXT) -> list[int]:
    """Each record's tokens after fitting to the context, in file order, as the pipeline makes them."""
    from qlora_fsdp.config import load_config
    from qlora_fsdp.data.pipeline import run_template, sources_of, tokenized
    from qlora_fsdp.loading.checkpoint import load_tokenizer

    cfg = load_config("tiny_cpu", [f"model.path={model}", f"data.path={data_file}", f"data.context_length={context}"])
    tokenizer = load_tokenizer(cfg)
    samples = tokenized(sources_of(cfg.data), tokenizer, cfg.data, run_template(cfg.data, tokenizer), 0)[0]
    return list(samples["length"])


def matching_split(lengths: list[int], wanted: int, context: int = CONTEXT) -> tuple[int, int, int]:
    """(records, packed rows per step, steps): the first number of records from `wanted` up whose packed rows
    split into exactly as many optimizer steps of equal rows as the peer's epoch of padded micro-batches."""
    from qlora_fsdp.data.batching import pack

    for n in range(wanted, len(lengths)):
        peer_steps = math.ceil(math.ceil(n / PEER_MICRO_BATCH) / PEER_ACCUM)
        rows = len(pack(lengths[:n], context))
        if rows % peer_steps == 0:  # every step takes whole rows: no row twice, none left out
            return n, rows // peer_steps, peer_steps
    raise SystemExit("no record count matches the peer's steps; raise --pool")


def micro_batching(rows_per_step: int, context: int = CONTEXT) -> tuple[int, int]:
    """(rows per micro-batch, accumulation steps): the fewest calls with at most MAX_TOKENS_PER_CALL each."""
    for accum in range(1, rows_per_step + 1):
        if rows_per_step % accum == 0 and rows_per_step // accum * context <= MAX_TOKENS_PER_CALL:
            return rows_per_step // accum, accum
    return 1, rows_per_step


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a benchmark run trains: the model (tiny, the real one, or a published architecture with random weights
    and `layers` of its layers), the context and the device."""

    real: bool = False
    arch: Path | None = None  # a config.json, e.g. model_configs/llama-3.1-8b/config.json
    layers: int = 8
    context: int = CONTEXT
    device: str = "cpu"


def arch_model(out: Path, data: Path, arch: Path, layers: int, device: str) -> Path:
    """`layers` layers of a published architecture, random weights (its initializer), its shapes and vocabulary,
    with a small tokenizer trained on the data (its ids fall inside the vocabulary); built on `device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qlora_fsdp.tools.tiny_model import train_tokenizer

    tokenizer = train_tokenizer(data, MODEL.vocab_size)
    config = AutoConfig.from_pretrained(arch.parent)
    config.num_hidden_layers = layers
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                                     tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def prepare(work: Path, records: int, eval_records: int, seed: int, setting: Setting = Setting()) -> Plan:
    pool = generate(records * 2 + eval_records, seed)
    write(work / "pool.jsonl", pool[eval_records:])
    write(work / "held_out.jsonl", pool[:eval_records])
    if setting.real:  # float32: bf16 has no hardware on this CPU (DESIGN.md)
        from qlora_fsdp.tools.real_model import make_real_model

        model, dtype = make_real_model(REAL_MODEL), "float32"
    elif setting.arch is not None:  # bf16 on a GPU; float32 on a CPU, which may have no bf16 units
        model = arch_model(work / "arch-model", work / "pool.jsonl", setting.arch, setting.layers, setting.device)
        dtype = "bfloat16" if setting.device != "cpu" else "float32"
    else:
        model, dtype = work / "bench-llama", "bfloat16"
        write_tiny_model(model, work / "pool.jsonl", MODEL)
    context = setting.context
    lengths = token_lengths(model, work / "pool.jsonl", context)
    n, per_step, steps = matching_split(lengths, records, context)
    write(work / "train.jsonl", pool[eval_records : eval_records + n])
    print_lengths(lengths[:n], context)
    rows, accum = micro_batching(per_step, context)
    print(f"{n} training records, {eval_records} held out; one epoch: {steps} optimizer steps of {PEER_MICRO_BATCH} x "
          f"{PEER_ACCUM} samples (peers) or {rows} x {accum} packed rows of {context} tokens (train.py)")
    return Plan(work / "train.jsonl", work / "held_out.jsonl", model, steps, rows, accum, dtype, context=context,
                device=setting.device)


def print_lengths(lengths: list[int], context: int = CONTEXT) -> None:
    ordered = sorted(lengths)

    def pct(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    print(f"training sample lengths (tokens, after fitting to {context}): median {statistics.median(ordered):.0f}, "
          f"mean {statistics.mean(ordered):.0f}, p90 {pct(0.9)}, p99 {pct(0.99)}, max {ordered[-1]}, "
          f"{sum(x >= context for x in ordered) / len(ordered):.1%} at the context length")
    edges = [0, 64, 128, 256, 512, 768, *(edge for edge in (1024, 2048, 4096) if edge < context), context]
    counts = [sum(lo < x <= hi for x in ordered) for lo, hi in zip(edges[:-1], edges[1:], strict=False)]
    print("  histogram: " + ", ".join(f"{lo + 1}-{hi}: {c}" for lo, hi, c in
                                     zip(edges[:-1], edges[1:], counts, strict=False)))


def our_overrides(plan: Plan, out: Path, settings: list[str]) -> list[str]:
    """train.py's keys over the tiny_cpu recipe for a run of the plan (also what the GPU check plans)."""
    # the peers' dtype (auto would pick float32 on a CPU without bf16 units)
    return [*settings, f"model.dtype={plan.dtype}", f"quant.compute_dtype={plan.dtype}",
            f"model.path={plan.model}", f"data.path={plan.train}",
            f"data.eval_path={plan.held_out}", "data.eval_samples=100000", "data.packing=true",
            f"data.context_length={plan.context}", f"data.micro_batch_size={plan.rows_per_micro_batch}",
            f"data.grad_accum_steps={plan.accum_steps}", f"optim.lr={SETTINGS['lr']}",
            f"optim.warmup_steps={plan.warmup_steps}", "optim.min_lr_ratio=0.0",  # the peer's cosine
            f"lora.r={SETTINGS['r']}", f"lora.alpha={SETTINGS['alpha']}", f"train.seed={SETTINGS['seed']}",
            "train.eval_every=0", f"train.max_steps={plan.steps}", f"train.output_dir={out}",
            "train.overwrite=true", "logging.plot=false"]


def run_ours(plan: Plan, out: Path, settings: list[str]) -> dict[str, Any]:
    from qlora_fsdp.api import train

    summary = train("tiny_cpu", our_overrides(plan, out, settings))
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"samples": summary["samples"], "steps": summary["steps"], "tokens": summary["tokens"],
            "positions": sum(s.get("positions", 0) for s in steps), "seconds": summary["train_runtime_s"],
            "eval_loss": summary["eval_loss_end"]}


def peer_base_model(plan: Plan) -> Any:
    """The peer's NF4 model as a Transformers user loads it, in the plan's dtype."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = getattr(torch, plan.dtype)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)
    placement = {"device_map": {"": plan.device}} if plan.device != "cpu" else {}
    return AutoModelForCausalLM.from_pretrained(plan.model, quantization_config=quant, dtype=dtype, **placement)


def run_peer(plan: Plan, out: Path, group_by_length: bool, compiled: bool = False) -> dict[str, Any]:
    """The Hugging Face Trainer with PEFT on the same NF4 model and the same token streams."""
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        DataCollatorForSeq2Seq,
        Trainer,
        TrainingArguments,
    )

    import qlora_fsdp  # noqa: F401  (quiets the same bitsandbytes notices)
    from qlora_fsdp.config import load_config
    from qlora_fsdp.data.batching import collate
    from qlora_fsdp.data.pipeline import load_dataset
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.losses.forward import loss_sum

    torch.manual_seed(SETTINGS["seed"])
    cfg = load_config("tiny_cpu", [f"model.path={plan.model}", f"data.path={plan.train}",
                                   f"data.eval_path={plan.held_out}", "data.eval_samples=100000",
                                   f"data.context_length={plan.context}"])
    tokenizer = load_tokenizer(cfg)
    data = load_dataset(tokenizer, cfg.data, SETTINGS["seed"])
    train_set = datasets.Dataset.from_dict({"input_ids": data.train["input_ids"], "labels": data.train["labels"]})
    base = peer_base_model(plan)  # on the GPU when there is one (bitsandbytes quantizes as it moves there)
    lora = LoraConfig(r=SETTINGS["r"], lora_alpha=SETTINGS["alpha"], target_modules="all-linear", task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, lora)
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=PEER_MICRO_BATCH, gradient_accumulation_steps=PEER_ACCUM,
        learning_rate=SETTINGS["lr"], warmup_steps=plan.warmup_steps, lr_scheduler_type="cosine",
        num_train_epochs=1, optim="paged_adamw_8bit", max_grad_norm=1.0, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, logging_steps=10, save_strategy="no",
        report_to=[], use_cpu=plan.device == "cpu", seed=SETTINGS["seed"], dataloader_num_workers=0,
        train_sampling_strategy="group_by_length" if group_by_length else "random", torch_compile=compiled,
    )
    positions = [0]

    def counting_collator(features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = padded(features)
        positions[0] += batch["input_ids"].numel()
        return batch

    padded = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    trainer = Trainer(model=peft_model, args=args, train_dataset=train_set, data_collator=counting_collator)
    result = trainer.train()
    peft_model.eval()
    samples = data.samples(data.eval, list(range(len(data.eval))))
    total, n_targets = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(samples), 16):
            batch = collate(samples[start : start + 16], tokenizer.pad_token_id)
            total += loss_sum(peft_model, batch, peft_model.device).item()
            n_targets += batch.n_targets
    return {"samples": len(train_set), "steps": result.global_step, "tokens": sum(data.train["length"]),
            "positions": positions[0], "seconds": result.metrics["train_runtime"], "eval_loss": total / n_targets}


def run_isolated(which: str, plan: Plan, work: Path, threads: int) -> dict[str, Any]:
    """Each run in a fresh process with the same threads (no caches shared in memory)."""
    result_file = work / f"{which}.json"
    command = [sys.executable, "-m", "benchmarks.training_speed", "--only", which,
               "--plan", json.dumps(dataclasses.asdict(plan), default=str), "--result", str(result_file),
               "--work", str(work)]
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return json.loads(result_file.read_text())


def run_one(which: str, plan: Plan, work: Path) -> dict[str, Any]:
    out = work / which
    if which.startswith("peer"):
        figures = run_peer(plan, out, group_by_length=which != "peer", compiled=which == "peer_compiled")
    else:
        figures = run_ours(plan, out, OUR_SETTINGS[which])
    return {**figures, "peak_rss_gib": peak_rss_gib(), **gpu_peak(plan.device)}


def gpu_peak(device: str) -> dict[str, float]:
    """The run's peak GPU memory, as PyTorch's allocator saw it (what the planner's figure is compared to)."""
    if device == "cpu":
        return {}
    import torch

    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def median_run(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose time is the median (the lower middle of an even count), with every round's time."""
    ordered = sorted(rounds, key=lambda r: r["seconds"])
    return {**ordered[(len(ordered) - 1) // 2], "all_seconds": [r["seconds"] for r in rounds]}


def print_table(results: dict[str, dict[str, Any]], label: str) -> None:
    print("\n| run | samples | steps | useful tokens | processed tokens | train time (median; every round) "
          "| useful tokens/s | samples/s | final held-out loss | peak RSS |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        rounds = ", ".join(f"{t:.1f}" for t in r["all_seconds"])
        print(f"| {RUNS[name]} | {r['samples']:.0f} | {r['steps']} | {r['tokens']:,.0f} | {r['positions']:,.0f} "
              f"({r['tokens'] / r['positions']:.0%} real) | {r['seconds']:.1f} s ({rounds}) "
              f"| {r['tokens'] / r['seconds']:,.0f} | {r['samples'] / r['seconds']:.2f} | {r['eval_loss']:.4f} "
              f"| {r['peak_rss_gib']:.2f} GiB |")
    rate = {name: r["tokens"] / r["seconds"] for name, r in results.items()}
    print()
    for name, what in (("ours_dense", "per-sample attention vs dense mask"),
                       ("ours_fp32_lora", "LoRA matmuls in the activations' dtype vs fp32"),
                       ("ours_peft_lora", "fused LoRA in the activations' dtype vs PEFT's forward")):
        if name in results:
            print(f"{what} (train.py): {rate['ours'] / rate[name]:.2f}x")
    if {"ours_fp32_lora", "ours_peft_lora"} <= results.keys():
        print(f"fused LoRA projections vs PEFT's forward, both fp32 (train.py): "
              f"{rate['ours_fp32_lora'] / rate['ours_peft_lora']:.2f}x")
    if {"ours_compiled", "peer_compiled"} <= results.keys():
        print(f"compiled: train.py vs the Trainer: {rate['ours_compiled'] / rate['peer_compiled']:.2f}x")
    if not {"peer", "peer_grouped", "ours"} <= results.keys():
        return
    loss_change = results["ours"]["eval_loss"] / results["peer"]["eval_loss"] - 1
    print(f"{label}useful tokens/s vs default peer: {rate['ours'] / rate['peer']:.2f}x; vs length-grouped peer: "
          f"{rate['ours'] / rate['peer_grouped']:.2f}x; held-out loss vs default peer: {loss_change:+.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=800, help="training records (a few more, to match steps)")
    parser.add_argument("--eval-records", type=int, default=200)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of every run")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--work", type=Path, help="folder for data, model and runs (default: a new temp folder)")
    parser.add_argument("--rounds", type=int, default=3, help="times each run is repeated, alternating")
    parser.add_argument("--model", choices=["tiny", "real"], default="tiny",
                        help="the 26.7M-parameter Llama built here (bf16), or SmolLM2-135M-Instruct (float32)")
    parser.add_argument("--warmup-steps", type=int, default=SETTINGS["warmup_steps"],
                        help="of every run; 0 matches the schedules exactly (the Trainer's first warmup step runs at "
                             "lr 0, ours at lr/(warmup+1)), which a run of a few steps needs for its held-out loss")
    parser.add_argument("--arch", type=Path, help="instead: a published architecture's config.json, random weights "
                        "(e.g. model_configs/llama-3.1-8b/config.json), --layers of its layers")
    parser.add_argument("--layers", type=int, default=8, help="of --arch's layers")
    parser.add_argument("--context", type=int, default=CONTEXT, help="tokens a row (train.py packs to it)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where every run trains")
    parser.add_argument("--only", choices=list(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:  # a child: one run
        plan = Plan.from_json(args.plan)
        started = time.time()
        args.result.write_text(json.dumps({**run_one(args.only, plan, args.work), "wall": time.time() - started}))
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="qlora-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    setting = Setting(real=args.model == "real", arch=args.arch, layers=args.layers, context=args.context,
                      device=args.device)
    plan = dataclasses.replace(prepare(work, args.records, args.eval_records, args.seed, setting),
                               warmup_steps=args.warmup_steps)
    (work / "plan.json").write_text(json.dumps(dataclasses.asdict(plan), default=str))  # benchmarks.step_profile
    runs = args.runs.split(",")
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name in runs:
            rounds[name].append(run_isolated(name, plan, work, args.threads))
    print_table({name: median_run(results) for name, results in rounds.items()},
                "real model (SmolLM2-135M-Instruct, float32): " if args.model == "real" else "")


if __name__ == "__main__":
    main()
