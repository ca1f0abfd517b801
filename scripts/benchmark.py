"""Useful (non-padding) tokens/s of train.py against the Hugging Face Trainer + PEFT, one CPU process each.

Same NF4 tiny model, LoRA config, context length, micro-batch, accumulation, checkpointing, optimizer,
schedule, and the same training samples (one epoch of a fixed subset of the shipped instruction data,
tokenized by our pipeline for both, so the token streams are identical); the final held-out loss of both
is measured by the same code on the same held-out records.

    python scripts/benchmark.py            # needs `make tiny-model`; about 10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TypedDict

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")

class Settings(TypedDict):
    context_length: int
    micro_batch_size: int
    grad_accum_steps: int
    lr: float
    warmup_steps: int
    r: int
    alpha: int
    seed: int


SETTINGS: Settings = {"context_length": 128, "micro_batch_size": 8, "grad_accum_steps": 2, "lr": 3e-3,
                      "warmup_steps": 10, "r": 16, "alpha": 32, "seed": 42}


def write_split(data_dir: Path, n_train: int, n_eval: int) -> tuple[Path, Path]:
    records = (REPO / "data" / "tiny_instruct.jsonl").read_text().splitlines()
    data_dir.mkdir(parents=True, exist_ok=True)
    train, held_out = data_dir / "train.jsonl", data_dir / "eval.jsonl"
    train.write_text("\n".join(records[:n_train]) + "\n")
    held_out.write_text("\n".join(records[n_train : n_train + n_eval]) + "\n")
    return train, held_out


def ours(model: str, train: Path, held_out: Path, out: Path, packing: bool, rows: int | None = None) -> dict:
    """train.py in one process, for one epoch of the training file (`rows`: packed rows per micro-batch)."""
    from qlora_fsdp.config import load_config
    from qlora_fsdp.data.pipeline import load_dataset
    from qlora_fsdp.model.build import load_tokenizer

    overrides = [f"model.path={model}", f"data.path={train}", f"data.eval_path={held_out}", "data.eval_samples=1000",
                 f"data.packing={packing}", f"data.context_length={SETTINGS['context_length']}",
                 f"data.micro_batch_size={rows or SETTINGS['micro_batch_size']}",
                 f"data.grad_accum_steps={SETTINGS['grad_accum_steps']}", f"optim.lr={SETTINGS['lr']}",
                 f"optim.warmup_steps={SETTINGS['warmup_steps']}", f"lora.r={SETTINGS['r']}",
                 f"lora.alpha={SETTINGS['alpha']}", f"train.seed={SETTINGS['seed']}", "train.eval_every=0",
                 f"train.output_dir={out}", "train.overwrite=true"]
    cfg = load_config("tiny_cpu", overrides)
    data = load_dataset(load_tokenizer(cfg), cfg.data, cfg.train.seed)
    steps = math.ceil(data.n_units / (cfg.data.micro_batch * cfg.data.grad_accum_steps))
    command = [sys.executable, str(REPO / "train.py"), "--recipe", "tiny_cpu", *overrides, f"train.max_steps={steps}"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "2"})
    summary = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    return {"samples": summary["samples"], "steps": steps, "tokens": summary["tokens"],
            "seconds": summary["train_runtime_s"], "eval_loss": summary["eval_loss_end"]}


def peer(model: str, train: Path, held_out: Path, out: Path) -> dict:
    """The Hugging Face Trainer with PEFT on the same NF4 model and the same token streams."""
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        BitsAndBytesConfig,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainingArguments,
    )

    import qlora_fsdp  # noqa: F401  (quiets the same bitsandbytes notices)
    from qlora_fsdp.config import load_config
    from qlora_fsdp.data.batching import collate
    from qlora_fsdp.data.pipeline import load_dataset
    from qlora_fsdp.model.build import load_tokenizer
    from qlora_fsdp.training.loop import loss_sum

    torch.manual_seed(SETTINGS["seed"])
    cfg = load_config("tiny_cpu", [f"model.path={model}", f"data.path={train}", f"data.eval_path={held_out}",
                                   "data.eval_samples=1000", f"data.context_length={SETTINGS['context_length']}"])
    tokenizer = load_tokenizer(cfg)
    data = load_dataset(tokenizer, cfg.data, SETTINGS["seed"])
    train_set = datasets.Dataset.from_dict({"input_ids": data.train["input_ids"], "labels": data.train["labels"]})
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(model, quantization_config=quant, dtype=torch.bfloat16)
    lora = LoraConfig(r=SETTINGS["r"], lora_alpha=SETTINGS["alpha"], target_modules="all-linear", task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, lora)
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=SETTINGS["micro_batch_size"],
        gradient_accumulation_steps=SETTINGS["grad_accum_steps"], learning_rate=SETTINGS["lr"],
        warmup_steps=SETTINGS["warmup_steps"], lr_scheduler_type="cosine", num_train_epochs=1,
        optim="paged_adamw_8bit", max_grad_norm=1.0, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, logging_steps=50, save_strategy="no",
        report_to=[], use_cpu=True, seed=SETTINGS["seed"], dataloader_num_workers=0,
    )
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    trainer = Trainer(model=peft_model, args=args, train_dataset=train_set, data_collator=collator)
    result = trainer.train()
    peft_model.eval()
    samples = data.samples(data.eval, list(range(len(data.eval))))
    total, n_targets = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(samples), 16):
            batch = collate(samples[start : start + 16], tokenizer.pad_token_id)
            total += loss_sum(peft_model, batch, torch.device("cpu")).item()
            n_targets += batch.n_targets
    return {"samples": len(train_set), "steps": result.global_step, "tokens": sum(data.train["length"]),
            "seconds": result.metrics["train_runtime"], "eval_loss": total / n_targets}


def run_isolated(which: str, args: argparse.Namespace, train: Path, held_out: Path, work: Path) -> dict:
    """Each contender in a fresh process (same threads, no shared caches in memory)."""
    result_file = work / f"{which}.json"
    command = [sys.executable, __file__, "--only", which, "--model", args.model, "--train", str(train),
               "--eval", str(held_out), "--work", str(work), "--result", str(result_file)]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    return json.loads(result_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "tiny-llama"))
    parser.add_argument("--train-samples", type=int, default=2400)
    parser.add_argument("--eval-samples", type=int, default=200)
    parser.add_argument("--only", choices=["packed", "packed_4", "grouped", "peer"], help=argparse.SUPPRESS)
    for hidden in ("--train", "--eval", "--work", "--result"):  # set by the parent for each contender
        parser.add_argument(hidden, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        train, held_out, work, result = args.train, args.eval, args.work, args.result
        started = time.time()
        if args.only == "peer":
            figures = peer(args.model, train, held_out, work / "peer")
        else:
            rows = 4 if args.only == "packed_4" else None
            figures = ours(args.model, train, held_out, work / args.only, args.only.startswith("packed"), rows)
        result.write_text(json.dumps({**figures, "wall": time.time() - started}))
        return
    work = Path(tempfile.mkdtemp(prefix="qlora-bench-"))
    train, held_out = write_split(work / "data", args.train_samples, args.eval_samples)
    contenders = ("peer", "grouped", "packed", "packed_4")
    results = {name: run_isolated(name, args, train, held_out, work) for name in contenders}
    print_table(results)


def print_table(results: dict[str, dict]) -> None:
    names = {"peer": "HF Trainer + PEFT (peer)", "grouped": "train.py, length-grouped",
             "packed": "train.py, packed, 8 rows a micro-batch",
             "packed_4": "train.py, packed, 4 rows a micro-batch (~8 samples)"}
    peer_rate = results["peer"]["tokens"] / results["peer"]["seconds"]
    peer_loss = results["peer"]["eval_loss"]
    print("\n| run | samples | steps | useful tokens | train time | useful tokens/s | vs peer | final eval loss "
          "| vs peer |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        rate = r["tokens"] / r["seconds"]
        print(f"| {names[name]} | {r['samples']:.0f} | {r['steps']} | {r['tokens']:,.0f} | {r['seconds']:.1f} s | "
              f"{rate:,.0f} | {rate / peer_rate:.2f}x | {r['eval_loss']:.4f} | {r['eval_loss'] / peer_loss - 1:+.1%} |")


if __name__ == "__main__":
    main()
