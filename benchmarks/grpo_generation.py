"""GRPO's generation: tokens/s of the policy's own sampling (qlora_fsdp/objectives/rollouts.py: our 4-bit model with
its LoRA, held as training holds it, in each generation layout) against transformers' `generate` on transformers +
bitsandbytes + PEFT's unsharded 4-bit model of the same checkpoint, the same rows, lengths and sampling, measured in
the same run.

    python -m benchmarks.grpo_generation --model models/smollm2-135m-instruct            # CPU, one process
    torchrun --nproc_per_node 2 -m benchmarks.grpo_generation --model models/smollm2-135m-instruct   # 2 gloo ranks
    python -m benchmarks.grpo_generation --arch llama-1b --device cuda --rows 32 --new-tokens 128 --plan-on h100

`--model`: a real checkpoint folder (`make real-model`); `--arch`: random weights in a Llama shape, written once to
--work. Every rank generates rows / world_size of the rows (its share, as a GRPO step splits them) in each layout;
transformers generates all of them in one process. No row stops early: the end-of-text id is one the model never
samples here (the vocabulary's last), on both sides, so both decode every row to --new-tokens.

On a GPU the table also has a decoding step's time, measured as the difference between calls of N and N/2 new
tokens (so the prompts' forward drops out), beside the plan's (plan/generation.py, for --plan-on) and the step's
memory-bandwidth bound: every 4-bit weight, the head and the mean KV cache read once.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ARCHES = {  # hidden, intermediate, layers, heads, kv heads, vocabulary
    "tiny": (128, 344, 4, 4, 2, 512),
    "llama-1b": (2048, 8192, 16, 32, 8, 128256),  # Llama 3.2 1B's shapes
    "llama-3b": (3072, 8192, 28, 24, 8, 128256),  # Llama 3.2 3B's shapes
}
QUESTIONS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
             "clips did Natalia sell altogether in April and May?", "What is 17 times 23?",
             "A train travels 60 km in 45 minutes. What is its speed in km per hour?", "Name three primary colours."]


class IdsOnly:
    """What generation asks of a tokenizer: ids, and an end-of-text id the model does not sample."""

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


def prompt_ids(folder: Path, arch: str | None, count: int, length: int) -> list[list[int]]:
    """A real model's chat prompts (GSM8K-like questions), or random ids for random weights."""
    if arch is not None:
        generator = torch.Generator().manual_seed(1)
        return [torch.randint(2, ARCHES[arch][5] - 1, (length,), generator=generator).tolist() for _ in range(count)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [str(tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                               add_generation_prompt=True, tokenize=False)) for i in range(count)]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


@dataclass
class Timed:
    tokens: int
    seconds: float
    peak_gib: float
    step_ms: float = float("nan")  # a decoding step (GPU: from two lengths)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def synchronize(device: torch.device, every_rank: bool = True) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if every_rank and dist.is_initialized():
        dist.barrier()


def timed(run: Callable[[int], int], device: torch.device, new_tokens: int, every_rank: bool = True) -> Timed:
    """A warm-up call (compilation, the allocator), then the call timed; on a GPU a half-length call too."""
    run(min(4, new_tokens))
    synchronize(device, every_rank)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    tokens = run(new_tokens)
    synchronize(device, every_rank)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    step_ms = float("nan")
    if device.type == "cuda" and new_tokens >= 8:
        started = time.perf_counter()
        run(new_tokens // 2)
        synchronize(device, every_rank)
        step_ms = (seconds - (time.perf_counter() - started)) / (new_tokens - new_tokens // 2) * 1e3
    return Timed(tokens, seconds, peak, step_ms)


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def ours(folder: Path, prompts: list[list[int]], layouts: list[str], args: argparse.Namespace, device: torch.device,
         info: Any) -> dict[str, Timed]:
    """Our model as training holds it (FSDP2 over the ranks), each layout timed on this rank's share of the rows."""
    from qlora_fsdp.config import GenerationConfig, load_config
    from qlora_fsdp.generation.plan import GenerationPlan
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.objectives.rollouts import generate

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = load_config("tiny_cpu", [f"model.path={folder}", f"model.dtype={dtype}", f"quant.compute_dtype={dtype}",
                                   "data.packing=false", "activation_checkpointing.mode=off"])
    model = build_sharded_model(cfg, info)
    model.generation_config.eos_token_id = None  # the tokenizer's (never sampled) ends a row, on both sides
    tokenizer: Any = IdsOnly(model.config.vocab_size)
    rank, size = world()
    mine = prompts[rank * len(prompts) // size : (rank + 1) * len(prompts) // size]
    out = {}
    for name in layouts:
        layout, graphs, kernels = parts(name, args)

        def run(new_tokens: int, layout: str = layout, graphs: str = graphs, kernels: str = kernels) -> int:
            grpo = GenerationPlan(GenerationConfig(
                num_generations=args.rows // len(prompts), max_completion_length=new_tokens,
                layout=layout, graphs=graphs, kernels=kernels),  # type: ignore[arg-type]
                prompts=len(mine), prompt_tokens=0)
            width = max(len(ids) for ids in prompts)  # one cache length for every call: one compiled step
            made = generate(model, tokenizer, mine, grpo, device, size, cache_tokens=width + 1 + args.new_tokens)
            counted = torch.tensor(float(generated_tokens(made.ids, tokenizer.eos_token_id)))
            if dist.is_initialized():
                dist.all_reduce(counted)
            return int(counted)

        torch.manual_seed(0)
        out[name] = timed(run, device, args.new_tokens)
    return out


def transformers_side(folder: Path, prompts: list[list[int]], args: argparse.Namespace,
                      device: torch.device) -> Timed:
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
    width = max(len(ids) for ids in rows)
    input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids in rows], device=device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows], device=device)
    eos = base.config.vocab_size - 1

    def run(new_tokens: int) -> int:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 do_sample=True, temperature=1.0, top_k=None, pad_token_id=0, eos_token_id=eos,
                                 use_cache=True)
        return generated_tokens(out[:, width:].tolist(), eos)

    threads = torch.get_num_threads()
    torch.set_num_threads(threads * world()[1])  # one process: the cores every rank had (the others wait)
    try:
        return timed(run, device, args.new_tokens, every_rank=False)
    finally:
        torch.set_num_threads(threads)


def planned(folder: Path, prompts: list[list[int]], args: argparse.Namespace, gpu: str, name: str,
            size: int) -> tuple[float, str]:
    """What --plan predicts for this call on `gpu` (plan/generation.py), before any process group exists: the
    decoding step in seconds, and the sentence."""
    layout, graphs, kernels = parts(name, args)
    from qlora_fsdp.config import load_config
    from qlora_fsdp.measure.fake_world import leave_fake_world
    from qlora_fsdp.plan.report import plan_recipe
    from qlora_fsdp.plan.time_report import recipe_generation

    width = max(len(ids) for ids in prompts)
    cfg = load_config("tiny_cpu_grpo", [
        f"model.path={folder}", "model.dtype=bfloat16", "quant.compute_dtype=bfloat16", f"hardware.gpu={gpu}",
        f"hardware.gpus_per_node={size}", "activation_checkpointing.mode=off",
        f"data.micro_batch_size={max(len(prompts) // size, 1)}", "data.grad_accum_steps=1",
        f"data.context_length={width + args.new_tokens}", f"generation.max_completion_length={args.new_tokens}",
        f"generation.num_generations={args.rows // len(prompts)}", f"generation.layout={layout}",
        f"generation.graphs={graphs}", f"generation.kernels={kernels}"])
    recipe = plan_recipe(cfg)
    leave_fake_world()
    assert recipe.result.step is not None
    made = recipe_generation(recipe.planning, recipe.planned, recipe.result.step)
    return made.decode_step, (
        f"planned on {gpu}, {name}: {made.total:.2f} s = {made.prefill:.2f} s over the prompts + {made.new_tokens} "
        f"decoding steps x {made.decode_step * 1e3:.1f} ms (link {made.decode_link * 1e3:.1f}, GPU "
        f"{made.decode_gpu * 1e3:.1f}, host {made.decode_host * 1e3:.1f})")


def planned_or_why_not(folder: Path, prompts: list[list[int]], args: argparse.Namespace, name: str,
                       size: int) -> tuple[float, str]:
    """The plan's figures, or NaN and why (the fake step needs torch 2.13; the GPU image has had 2.11)."""
    try:
        return planned(folder, prompts, args, args.plan_on, name, size)
    except Exception as error:  # noqa: BLE001 (the measurement stands without the prediction)
        first = (str(error).splitlines() or [""])[0][:120]
        return float("nan"), f"{name}: no plan here (torch {torch.__version__}: {type(error).__name__}: {first})"


def bandwidth_bound_ms(folder: Path, rows: int, prompt: int, new: int, bandwidth: float) -> float:
    """A decoding step reading, once, every 4-bit weight (half a byte an element and its 8-bit absmax a 64-block:
    1/64 byte), LoRA r16 in bf16 on every linear, the head in bf16, and the KV cache's live part (over a call, on
    average the prompt and half the completion), at `bandwidth` bytes/s."""
    from transformers import AutoConfig

    from qlora_fsdp.generation.room import head_dim, kv_cache_bytes

    hf = AutoConfig.from_pretrained(folder)
    q_width, kv_width = hf.num_attention_heads * head_dim(hf), hf.num_key_value_heads * head_dim(hf)
    hidden, inter = hf.hidden_size, hf.intermediate_size
    linear = hf.num_hidden_layers * (2 * hidden * q_width + 2 * hidden * kv_width + 3 * hidden * inter)
    lora = 16 * hf.num_hidden_layers * (2 * (hidden + q_width) + 2 * (hidden + kv_width) + 3 * (hidden + inter))
    four_bit = linear * (0.5 + 1 / 64)
    head_bytes = hf.vocab_size * hidden * 2
    cache = kv_cache_bytes(hf, rows, prompt + new // 2, 2)
    return (four_bit + 2 * lora + head_bytes + cache) / bandwidth * 1e3


def measured_bandwidth(device: torch.device) -> float:
    """The card's copy bandwidth, bytes read and written a second (a 1 GiB copy, the best of five), beside its
    datasheet figure: what a decoding step can reach."""
    source = torch.empty(2**30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * source.numel() / best


def generated_tokens(rows: list[list[int]], end: int) -> int:
    """Each row's tokens through its first end-of-text id (GRPO's cut), counted the same way for both sides."""
    return sum(row.index(end) + 1 if end in row else len(row) for row in rows)


def idle_until_rank0_is_done(rank: int, size: int) -> None:
    """The other ranks wait without spinning (a gloo barrier polls a core), so transformers' one process has the
    cores to itself."""
    if size == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("grpo_generation_done", "1")
        return
    while not store.check(["grpo_generation_done"]):
        time.sleep(0.5)


def init_world(device: torch.device) -> Any:
    from qlora_fsdp.distributed import init_distributed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    return init_distributed()


@dataclass
class Measured:
    """One run's figures (rank 0's)."""

    title: str
    mine: dict[str, Timed]
    theirs: Timed | None
    bound_ms: float | None  # the bandwidth bound of a decoding step on --plan-on (its datasheet bandwidth)
    predictions: dict[str, tuple[float, str]]
    measured_bound_ms: float | None = None  # the same at the bandwidth measured on this card (a GPU)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a checkpoint folder (e.g. models/smollm2-135m-instruct)")
    parser.add_argument("--arch", choices=sorted(ARCHES), help="random weights in this shape instead")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rows", type=int, default=16, help="completions generated in all (prompts x 8)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="random prompts' length (--arch)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--layouts", default="all", help="comma-separated layouts, or all the world size has")
    parser.add_argument("--graphs", choices=["auto", "on", "off", "both"], default="auto",
                        help="generation.graphs: the decoding step as a CUDA graph (auto: on a GPU; both: the "
                        "gathered layout measured with and without)")
    parser.add_argument("--kernels", choices=["auto", "fused", "off", "both"], default="auto",
                        help="generation.kernels: the fused NF4 + LoRA and decode attention kernels (auto: on "
                        "sm86/89/90 GPUs; both: each generator measured with and without)")
    parser.add_argument("--work", type=Path, default=Path("outputs/bench-grpo-generation"))
    parser.add_argument("--plan-on", metavar="GPU", help="also print what --plan predicts on GPU (a hardware.gpu "
                        "name, e.g. h100), and the bandwidth bound there")
    parser.add_argument("--skip-transformers", action="store_true", help="ours only")
    parser.add_argument("--plan-only", action="store_true", help="with --plan-on: the plan's decoding step for each "
                        "generator and the bandwidth bound, nothing run (a config.json is written for --arch)")
    args = parser.parse_args(argv)
    if (args.model is None) == (args.arch is None):
        parser.error("give --model or --arch")
    return args


def variants(args: argparse.Namespace, size: int) -> list[str]:
    """The generators of ours to time: `layout:graphs:kernels` (--graphs both: the gathered layout with graphs on
    and off; --kernels both: each with the fused kernels and without)."""
    layouts = (["gathered", "split", "per_token"] if size > 1 else ["gathered"]) if args.layouts == "all" \
        else args.layouts.split(",")
    kernels = ("fused", "off") if args.kernels == "both" else (args.kernels,)
    names = []
    for layout in layouts:
        graphs = ("on", "off") if args.graphs == "both" and layout == "gathered" else \
            ("off",) if args.graphs == "both" else (args.graphs,)
        names += [f"{layout}:{graph}:{kernel}" for graph in graphs for kernel in kernels]
    return names


def parts(name: str, args: argparse.Namespace) -> tuple[str, str, str]:
    """(layout, graphs, kernels) of a generator's name; what it leaves out, the command line's."""
    layout, graphs, kernels = (name.split(":") + ["", ""])[:3]
    return layout, graphs or args.graphs, kernels or args.kernels


def measure(args: argparse.Namespace) -> Measured | None:
    """Ours on every rank, then transformers' on rank 0 alone; rank 0's figures (None on the others)."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else \
        torch.device("cpu")
    folder = args.model or write_checkpoint(args.arch, args.work / args.arch)
    prompts = prompt_ids(folder, args.arch, max(args.rows // 8, 1), args.prompt_tokens)
    size = int(os.environ.get("WORLD_SIZE", 1))
    names = variants(args, size)
    # planned before any process group exists (the planner builds its own fake one)
    predictions = {name: planned_or_why_not(folder, prompts, args, name, size) for name in names} \
        if args.plan_on and os.environ.get("RANK", "0") == "0" else {}
    info = init_world(device)
    rank, size = world()
    mine = ours(folder, prompts, names, args, device, info)
    theirs = transformers_side(folder, prompts, args, device) if rank == 0 and not args.skip_transformers else None
    idle_until_rank0_is_done(rank, size)
    if rank != 0:
        return None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    width = max(len(ids) for ids in prompts)
    title = (f"GRPO generation, {folder.name} (NF4 + LoRA r16), {args.rows} rows x {width} prompt tokens at most, "
             f"{args.new_tokens} new tokens, {size} rank{'s' if size > 1 else ''} on {name}, graphs {args.graphs}")
    from qlora_fsdp.run.accelerators import GPUS

    rows = args.rows // size
    bound = bandwidth_bound_ms(folder, rows, width, args.new_tokens, GPUS[args.plan_on].memory_gbps * 1e9) \
        if args.plan_on else None
    measured = bandwidth_bound_ms(folder, rows, width, args.new_tokens, measured_bandwidth(device)) \
        if device.type == "cuda" else None
    return Measured(title, mine, theirs, bound, predictions, measured)


def report(measured: Measured) -> str:
    lines = [measured.title, "",
             "| generator | new tokens | seconds | tokens/s | vs transformers | decoding step ms | peak GPU GiB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    theirs = measured.theirs
    rows: list[tuple[str, Timed]] = [(f"ours, {name}", t) for name, t in measured.mine.items()]
    if theirs is not None:
        rows.append(("transformers generate (bitsandbytes + PEFT, one process)", theirs))
    for label, t in rows:
        versus = f"{t.rate / theirs.rate:.2f}x" if theirs is not None else ""
        lines.append(f"| {label} | {t.tokens} | {t.seconds:.2f} | {t.rate:,.0f} | {versus} | {t.step_ms:.1f} | "
                     f"{t.peak_gib:.2f} |")
    if measured.measured_bound_ms is not None:
        lines += ["", f"bandwidth bound of a decoding step at this card's measured copy bandwidth: "
                  f"{measured.measured_bound_ms:.2f} ms"]
    if measured.bound_ms is not None:
        lines += ["", f"bandwidth bound of a decoding step at the datasheet's bandwidth: {measured.bound_ms:.2f} ms"]
        for name, t in measured.mine.items():
            planned_step, words = measured.predictions[name]
            ratio = planned_step * 1e3 / t.step_ms
            lines.append(f"{words}; measured {t.step_ms:.1f} ms a decoding step (plan / measured {ratio:.2f}, "
                         f"measured / bound {t.step_ms / measured.bound_ms:.2f})")
    return "\n".join(lines)


def plan_only(args: argparse.Namespace) -> str:
    """The plan's figures and the datasheet's bound for the generators, from config.json alone."""
    from qlora_fsdp.run.accelerators import GPUS

    folder = args.model or write_checkpoint(args.arch, args.work / f"{args.arch}-config", weights=False)
    prompts = prompt_ids(folder, args.arch, max(args.rows // 8, 1), args.prompt_tokens)
    width = max(len(ids) for ids in prompts)
    bound = bandwidth_bound_ms(folder, args.rows, width, args.new_tokens, GPUS[args.plan_on].memory_gbps * 1e9)
    lines = [planned(folder, prompts, args, args.plan_on, name, 1)[1] for name in variants(args, 1)]
    return "\n".join([*lines, f"bandwidth bound of a decoding step at the datasheet's bandwidth: {bound:.2f} ms"])


def main() -> None:
    args = parse_args()
    if args.plan_only:
        print(plan_only(args))
        return
    measured = measure(args)
    if measured is not None:
        print(report(measured))


if __name__ == "__main__":
    main()
