"""GGUF export of SmolLM2-135M-Instruct + a LoRA adapter: per output type, the file's size, the export's time (from
the adapter: merge and conversion, in a fresh process as a user runs it; from a merged folder: conversion alone), and
the logits of the file as transformers' GGUF reader loads it against the adapter merged in float32.

    python -m benchmarks.gguf_export --out-dir /tmp/bench-gguf          # models/smollm2-135m-instruct (make real-model)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qlora_fsdp.config import Config, to_yaml
from qlora_fsdp.loading.adapter import TRAINING_CONFIG, config_for_adapter
from qlora_fsdp.tools.adapter_merge import merge_adapter

TYPES = ("f16", "bf16", "q8_0")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a primary colour."}],
         [{"role": "user", "content": "Reverse the letters of the word river."},
          {"role": "assistant", "content": "revir"}, {"role": "user", "content": "And of the word stone?"}]]


def write_adapter(base: Path, out: Path) -> Path:
    """A PEFT LoRA adapter on every linear (r=16, B seeded far from zero), with the tokenizer and training config."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.01 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    cfg = Config()
    cfg.model.path, cfg.model.dtype, cfg.quant.compute_dtype = str(base), "float32", "float32"
    cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules = 16, 32, TARGETS
    (out / TRAINING_CONFIG).write_text(to_yaml(cfg))
    return out


def timed_export(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "scripts/export_gguf.py", *argv], check=True, capture_output=True)
    return time.perf_counter() - started


def chat_logits(model: torch.nn.Module, tokenizer) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for chat in CHATS:
            ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            out.append(model(input_ids=ids).logits[0])
    return out


def compare(got: list[torch.Tensor], ref: list[torch.Tensor]) -> str:
    """Relative (Frobenius) difference, largest absolute difference, and how often the top token agrees."""
    a, b = torch.cat(got), torch.cat(ref)
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    return f"{float((a - b).norm() / b.norm()):.2e} | {float((a - b).abs().max()):.3f} | {100 * agree:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    shutil.rmtree(args.out_dir, ignore_errors=True)
    adapter = write_adapter(args.model, args.out_dir / "run" / "adapter")
    reference = args.out_dir / "merged-fp32"
    merge_adapter(config_for_adapter(adapter, None, []), adapter, reference, "float32")
    tokenizer = AutoTokenizer.from_pretrained(reference)
    ref = chat_logits(AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval(), tokenizer)
    base = chat_logits(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval(), tokenizer)
    print(f"the adapter's own effect (base vs merged): {compare(base, ref)}\n")
    print("| type | size (MB) | export from the adapter (s) | from the merged folder (s) | relative | max abs "
          "| top-1 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for outtype in TYPES:
        out = args.out_dir / outtype
        from_adapter = timed_export(["--adapter", str(adapter), "--out", str(out), "--outtype", outtype])
        from_merged = timed_export(["--model", str(reference), "--out", str(out) + "-m", "--outtype", outtype])
        (file,) = out.glob("*.gguf")
        model = AutoModelForCausalLM.from_pretrained(out, gguf_file=file.name, dtype=torch.float32).eval()
        print(f"| {outtype} | {file.stat().st_size / 1e6:.1f} | {from_adapter:.1f} | {from_merged:.1f} | "
              f"{compare(chat_logits(model, tokenizer), ref)} |")


if __name__ == "__main__":
    main()
