"""GRPO's generation: tokens/s of the policy's own sampling (qlora_fsdp/objectives/rollouts.py: our 4-bit model with
its LoRA, held as training holds it, one process) against transformers' `generate` on transformers + bitsandbytes +
PEFT's 4-bit model of the same checkpoint, the same rows, lengths and sampling, measured in the same run.

    python -m benchmarks.grpo_generation                       # CPU: a tiny Llama, fp32
    python -m benchmarks.grpo_generation --arch llama-1b --device cuda --rows 32 --new-tokens 128

The checkpoint is random weights in a Llama shape (`--arch`), written once to --work. Both sides sample every row to
the same length (a random model rarely samples EOS; a row that does is still counted to the batch's end, on both).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ARCHES = {  # hidden, intermediate, layers, heads, kv heads, vocabulary
    "tiny": (128, 344, 4, 4, 2, 512),
    "llama-1b": (2048, 8192, 16, 32, 8, 128256),  # Llama 3.2 1B's shapes
    "llama-3b": (3072, 8192, 28, 24, 8, 128256),  # Llama 3.2 3B's shapes
}


class IdsOnly:
    """What generation asks of a tokenizer, for a model without one: ids (prompts are random ids here)."""

    def __init__(self, vocab: int) -> None:
        self.pad_token_id, self.eos_token_id = 0, vocab - 1

    def decode(self, ids: list[int], **kwargs: object) -> str:
        return ""


def write_checkpoint(arch: str, folder: Path, weights: bool = True) -> Path:
    """Random weights in the arch's shape (or its config.json alone: a plan reads nothing else)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if any(folder.glob("*.safetensors")) or (not weights and (folder / "config.json").is_file()):
        return folder
    hidden, inter, layers, heads, kv, vocab = ARCHES[arch]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, bos_token_id=1,
                         eos_token_id=vocab - 1, tie_word_embeddings=False)
    if not weights:
        config.save_pretrained(folder)
        return folder
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


@dataclass
class Timed:
    tokens: int
    seconds: float
    peak_gib: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def timed(run, device: torch.device) -> Timed:  # noqa: ANN001 (a callable returning the new tokens' tensor width)
    run(4)  # warm-up: kernels, allocator
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    tokens = run(None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return Timed(tokens, time.perf_counter() - started, peak)


def ours(folder: Path, prompts: list[list[int]], args: argparse.Namespace, device: torch.device) -> Timed:
    from qlora_fsdp.config import GrpoConfig, load_config
    from qlora_fsdp.distributed import init_distributed
    from qlora_fsdp.loading.factory import build_model
    from qlora_fsdp.objectives.rollouts import generate

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = load_config("tiny_cpu", [f"model.path={folder}", f"model.dtype={dtype}", f"quant.compute_dtype={dtype}",
                                   "data.packing=false", "activation_checkpointing.mode=off"])
    model = build_model(cfg, init_distributed())
    tokenizer: Any = IdsOnly(ARCHES[args.arch][5])  # generate reads its ids only

    def run(new_tokens: int | None) -> int:
        grpo = GrpoConfig(num_generations=args.rows // len(prompts),
                          max_completion_length=new_tokens or args.new_tokens)
        made = generate(model, tokenizer, prompts, grpo, device, 1)
        return len(made.ids) * max(len(ids) for ids in made.ids)

    return timed(run, device)


def transformers_side(folder: Path, prompts: list[list[int]], args: argparse.Namespace, device: torch.device) -> Timed:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype)
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=dtype, device_map=device)
    for module in base.modules():  # on a CPU, the kernel training uses (bitsandbytes' repacked one needs other shapes)
        if hasattr(module, "support_avx512bf16_for_cpu"):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=16, target_modules="all-linear")).eval()
    rows = [ids for ids in prompts for _ in range(args.rows // len(prompts))]
    input_ids = torch.tensor(rows, device=device)

    def run(new_tokens: int | None) -> int:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=new_tokens or args.new_tokens, do_sample=True, temperature=1.0,
                                 top_k=None, pad_token_id=0, eos_token_id=ARCHES[args.arch][5] - 1, use_cache=True)
        return len(rows) * (out.shape[1] - input_ids.shape[1])

    return timed(run, device)


def planned(folder: Path, prompts: list[list[int]], args: argparse.Namespace, gpu: str) -> str:
    """What --plan predicts for this call on `gpu` (plan/generation.py), before any process group exists."""
    from qlora_fsdp.config import load_config
    from qlora_fsdp.measure.fake_world import leave_fake_world
    from qlora_fsdp.plan.report import plan_recipe
    from qlora_fsdp.plan.time_report import recipe_generation

    cfg = load_config("tiny_cpu_grpo", [
        f"model.path={folder}", "model.dtype=bfloat16", "quant.compute_dtype=bfloat16", f"hardware.gpu={gpu}",
        "activation_checkpointing.mode=off", f"data.micro_batch_size={len(prompts)}", "data.grad_accum_steps=1",
        f"data.context_length={args.prompt_tokens + args.new_tokens}", f"grpo.max_completion_length={args.new_tokens}",
        f"grpo.num_generations={args.rows // len(prompts)}"])
    recipe = plan_recipe(cfg)
    leave_fake_world()
    assert recipe.result.step is not None
    made = recipe_generation(recipe.planned, recipe.result.step)
    return (f"planned on {gpu} (plan/generation.py): {made.total:.2f} s = {made.prefill:.2f} s over the prompts + "
            f"{made.new_tokens} decoding steps x {made.decode_step * 1e3:.1f} ms (link {made.decode_link * 1e3:.1f}, "
            f"GPU {made.decode_gpu * 1e3:.1f}, host {made.decode_host * 1e3:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ARCHES), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rows", type=int, default=16, help="completions generated together (prompts x 8)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--work", type=Path, default=Path("outputs/bench-grpo-generation"))
    parser.add_argument("--plan-on", metavar="GPU", help="also print what --plan predicts for this call on GPU (a "
                        "hardware.gpu name, e.g. h100); planned on the CPU, with torch 2.13's fake tensors")
    parser.add_argument("--plan-only", action="store_true", help="print the prediction, measure nothing")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    folder = write_checkpoint(args.arch, args.work / args.arch, weights=not args.plan_only)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, ARCHES[args.arch][5] - 1, (args.prompt_tokens,), generator=generator).tolist()
               for _ in range(max(args.rows // 8, 1))]
    prediction = planned(folder, prompts, args, args.plan_on) if args.plan_on else None
    if args.plan_only:
        print(prediction)
        return
    torch.manual_seed(0)
    mine = ours(folder, prompts, args, device)
    theirs = transformers_side(folder, prompts, args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"GRPO generation, {args.arch} (random weights, NF4 + LoRA r16), {args.rows} rows x {args.prompt_tokens} "
          f"prompt tokens, {args.new_tokens} new tokens, on {name}\n")
    print("| generator | new tokens | seconds | tokens/s | peak GPU GiB |\n| --- | ---: | ---: | ---: | ---: |")
    for label, t in (("ours (rollouts.generate, training's model)", mine),
                     ("transformers generate (bitsandbytes + PEFT)", theirs)):
        print(f"| {label} | {t.tokens} | {t.seconds:.2f} | {t.rate:,.0f} | {t.peak_gib:.2f} |")
    print(f"\nours / transformers: {mine.rate / theirs.rate:.2f}x")
    if prediction:
        print(f"{prediction}; measured {mine.seconds:.2f} s ({mine.seconds / args.new_tokens * 1e3:.1f} ms a token)")


if __name__ == "__main__":
    main()
