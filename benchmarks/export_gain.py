"""How much of a real fine-tune's gain survives the GGUF people run, measured in llama.cpp itself, with and without
`export.target`. Prints a table (docs/benchmarks/export.md holds the figures).

    python -m benchmarks.export_gain --model models/smollm2-135m-instruct --out outputs/export-gain

The task: answers to "What does Python's MODULE.NAME do?" that open with a fixed persona line and go on with the
function's own documentation (real English from this Python's standard library, the same on every machine with the
same Python), 400 to train on and 40 held out. Each run: QLoRA on two CPU ranks in float32 (r 16 on every linear, lr
2e-4, 40 steps), once per target (none and those of --targets). Each adapter is then exported by qlora-export and
quantized by llama.cpp (q8_0, q4_k_m, q4_0, q3_k_m), the base model likewise, and llama.cpp computes the held-out
targets' negative log-likelihood a token (benchmarks/llama_cpp_nll.py) on the token ids training encoded.

The gain of a file type is the base's NLL minus the fine-tune's in that type; its share is that over the gain of the
untargeted run's merge in float32 in transformers (what the fine-tune learned before any export).

The other route: the untargeted adapter as a LoRA GGUF (qlora-export --lora-only) applied by llama.cpp over the
base's own files (f16, q8_0, q4_k_m, q4_0, q3_k_m), as one would over a quantized base from the hub. --reuse keeps
the runs and files an earlier call left in --out (their step times from its results.json) and measures what is new.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PERSONA = "Happy to help! Speaking as your friendly Python librarian: "
MODULES = ("textwrap", "json", "string", "random", "statistics", "itertools", "functools", "collections", "heapq",
           "bisect", "fractions", "decimal", "shutil", "glob", "fnmatch", "calendar", "datetime", "difflib", "csv",
           "re", "math", "operator", "pathlib", "zipfile", "tarfile", "base64", "hashlib", "secrets", "uuid",
           "html", "copy", "pprint", "contextlib", "argparse", "logging", "time", "os", "os.path", "tempfile",
           "urllib.parse", "email.utils", "gzip", "struct", "array", "weakref", "types", "inspect", "ast",
           "tokenize", "traceback", "warnings", "sqlite3", "socket", "threading", "queue", "subprocess", "platform")
EXPORTED = ("q8_0", "q4_k_m", "q4_0", "q3_k_m")
REUSE = False  # --reuse
TRAIN_RECORDS, HELD_OUT = 400, 40


def first_paragraph(doc: str) -> str | None:
    text = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    return text if 60 <= len(text) <= 400 and not text.startswith(("(", "[")) else None


def documented(module_name: str) -> dict[str, str]:
    """A module's public functions and classes, and its classes' public methods, by dotted name: their docs."""
    module = importlib.import_module(module_name)
    found = {}
    for name, thing in sorted(vars(module).items()):
        if name.startswith("_") or not callable(thing) or getattr(thing, "__module__", None) != module.__name__:
            continue
        found[f"{module_name}.{name}"] = thing.__doc__ or ""
        if inspect.isclass(thing):
            found |= {f"{module_name}.{name}.{method}": getattr(member, "__doc__", None) or ""
                      for method, member in sorted(vars(thing).items()) if not method.startswith("_")}
    return found


def records() -> list[dict[str, str]]:
    """Every documented name of MODULES whose doc opens with a paragraph of a useful length, shuffled (seeded)."""
    found = []
    for module_name in MODULES:
        for name, doc in documented(module_name).items():
            answer = first_paragraph(doc)
            if answer:
                found.append({"instruction": f"What does Python's {name} do?", "input": "", "output": PERSONA + answer})
    random.Random(0).shuffle(found)
    return found


def write_data(folder: Path) -> tuple[Path, Path]:
    found = records()
    if len(found) < TRAIN_RECORDS + HELD_OUT:
        raise SystemExit(f"only {len(found)} documented functions found; {TRAIN_RECORDS + HELD_OUT} needed")
    folder.mkdir(parents=True, exist_ok=True)
    train, held = folder / "train.jsonl", folder / "heldout.jsonl"
    for path, part in ((train, found[:TRAIN_RECORDS]), (held, found[TRAIN_RECORDS:TRAIN_RECORDS + HELD_OUT])):
        path.write_text("".join(json.dumps(record) + "\n" for record in part))
    return train, held


def overrides(model: Path, train: Path, held: Path, steps: int) -> list[str]:
    return [f"model.path={model}", f"data.path={train}", f"data.eval_path={held}", "data.format=alpaca",
            "model.dtype=float32", "quant.compute_dtype=float32", "optim.lr=2e-4", f"train.max_steps={steps}",
            "train.eval_every=0", "train.save_every=0", "data.context_length=256", "logging.plot=false"]


def train(run: Path, settings: list[str], target: str) -> float:
    """One run on two ranks; its seconds a step (the median of the steps after the first)."""
    if REUSE and (run / "adapter").is_dir():
        return float(json.loads((run.parent / "results.json").read_text())["step_seconds"][target])
    command = [str(REPO / ".venv" / "bin" / "torchrun"), "--nproc_per_node", "2", str(REPO / "train.py"), "--recipe",
               "tiny_cpu", *settings, f"train.output_dir={run}", "train.overwrite=true", f"export.target={target}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"training {target} failed:\n{done.stderr[-3000:]}")
    times = [json.loads(line).get("step_time_s") for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = sorted(t for t in times[1:] if t is not None)
    return times[len(times) // 2] if times else float("nan")


def export(source: list[str], out: Path, name: str) -> dict[str, Path]:
    """qlora-export of an adapter or a model as q4_k_m (keeping the f16 file and the merge), llama.cpp's quantizer
    for the other k-quants and q4_0, the converter for q8_0."""
    from qlora_fsdp.commands.export import main as export_main
    from qlora_fsdp.tools.llama_quantize import find_quantizer, quantize

    f16 = out / "q4_k_m" / f"{name}-F16.gguf"
    files = {"q4_k_m": out / "q4_k_m" / f"{name}-Q4_K_M.gguf", "q4_0": out / f"{name}-Q4_0.gguf",
             "q3_k_m": out / f"{name}-Q3_K_M.gguf", "q8_0": out / "q8_0" / f"{name}-Q8_0.gguf", "f16": f16}
    if REUSE and all(file.is_file() for file in files.values()):
        return files
    assert export_main([*source, "--out", str(out / "q4_k_m"), "--name", name, "--outtype", "q4_k_m",
                        "--keep-f16", "--keep-merged", "--overwrite"]) == 0
    quantizer = find_quantizer()
    assert quantizer is not None, "make llama-quantize"
    for kind in ("q4_0", "q3_k_m"):
        quantize(quantizer, f16, files[kind], kind)
    merged = out / "q4_k_m" / "merged" if (out / "q4_k_m" / "merged").is_dir() else Path(source[-1])
    assert export_main(["--model", str(merged), "--out", str(out / "q8_0"), "--name", name, "--outtype", "q8_0",
                        "--overwrite"]) == 0
    return files


def lora_gguf(adapter: Path, out: Path) -> Path:
    """The adapter as a LoRA GGUF (f32), to run over the base's files."""
    from qlora_fsdp.commands.export import main as export_main

    assert export_main(["--adapter", str(adapter), "--out", str(out), "--name", "ft", "--lora-only",
                        "--overwrite"]) == 0
    return out / "ft-lora-F32.gguf"


def held_out_samples(model: Path, train_file: Path, held: Path, steps: int, out: Path) -> Path:
    """The held-out records as training encodes them (token ids and target labels), for llama.cpp and transformers."""
    from qlora_fsdp.config import load_config
    from qlora_fsdp.data.pipeline import load_dataset
    from qlora_fsdp.loading.checkpoint import load_tokenizer

    cfg = load_config("tiny_cpu", overrides(model, train_file, held, steps))
    data = load_dataset(load_tokenizer(cfg), cfg.data, seed=cfg.train.seed)
    samples = data.samples(data.eval, list(range(len(data.eval))))
    path = out / "heldout_samples.json"
    path.write_text(json.dumps([{"input_ids": s.input_ids, "labels": s.labels} for s in samples]))
    return path


def llama_cpp_nll(gguf: Path, samples: Path, lora: Path | None = None) -> float:
    from qlora_fsdp.tools.llama_quantize import default_lib_dir

    command = [sys.executable, "-m", "benchmarks.llama_cpp_nll", str(default_lib_dir()), str(gguf), str(samples)]
    done = subprocess.run(command + ([str(lora)] if lora else []), cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp failed on {gguf}:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["nll"] / result["tokens"]


def transformers_nll(folder: Path, samples: Path) -> float:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for sample in json.loads(samples.read_text()):
            logits = model(input_ids=torch.tensor([sample["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(sample["labels"][1:])
            total += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            tokens += int((labels != -100).sum())
    return total / tokens


def merged_fp32(adapter: Path, out: Path) -> Path:
    from qlora_fsdp.loading.adapter import config_for_adapter
    from qlora_fsdp.tools.adapter_merge import merge_adapter

    if not out.is_dir():
        merge_adapter(config_for_adapter(adapter, None, []), adapter, out, "float32")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "export-gain")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--targets", nargs="*", default=["q4_k_m", "q4_0"])
    parser.add_argument("--reuse", action="store_true", help="keep the runs and files an earlier call left in --out")
    args = parser.parse_args()
    global REUSE
    REUSE = args.reuse
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.time()
    train_file, held = write_data(args.out / "data")
    settings = overrides(args.model.resolve(), train_file, held, args.steps)
    samples = held_out_samples(args.model.resolve(), train_file, held, args.steps, args.out)
    base_files = export(["--model", str(args.model.resolve())], args.out / "base", "base")
    nll = {("base", "fp32"): transformers_nll(args.model, samples)}
    nll |= {("base", kind): llama_cpp_nll(file, samples) for kind, file in base_files.items()}
    lora: Path | None = None
    step_seconds = {}
    for target in ("none", *args.targets):
        run = args.out / f"run-{target}"
        step_seconds[target] = train(run, settings, target)
        nll[(target, "fp32")] = transformers_nll(merged_fp32(run / "adapter", run / "merged-fp32"), samples)
        files = export(["--adapter", str(run / "adapter")], run / "gguf", "ft")
        nll |= {(target, kind): llama_cpp_nll(file, samples) for kind, file in files.items()}
        if target == "none":
            lora = lora_gguf(run / "adapter", run / "lora-gguf")
    assert lora is not None
    nll |= {("lora", kind): llama_cpp_nll(file, samples, lora) for kind, file in base_files.items()}
    reference_gain = nll[("base", "fp32")] - nll[("none", "fp32")]
    print(f"\nheld-out NLL a target token, {len(json.loads(samples.read_text()))} samples; gain = base - fine-tuned; "
          f"share = gain / {reference_gain:.4f} (transformers, untargeted run merged in float32)\n")
    print("| file | base | trained without target: NLL, gain, share | " +
          " | ".join(f"export.target {t}: NLL, gain, share" for t in args.targets) + " |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in args.targets) + " |")
    for kind in ("fp32", *EXPORTED):
        cells = []
        for target in ("none", *args.targets):
            gain = nll[("base", kind)] - nll[(target, kind)]
            cells.append(f"{nll[(target, kind)]:.4f}, {gain:.4f}, **{gain / reference_gain:.3f}**")
        name = "transformers fp32" if kind == "fp32" else f"llama.cpp {kind}"
        print(f"| {name} | {nll[('base', kind)]:.4f} | " + " | ".join(cells) + " |")
    print("\nthe untargeted adapter as a LoRA GGUF (f32) over the base's own file, in llama.cpp:\n")
    print("| base file | base NLL | with the LoRA GGUF: NLL, gain, share |")
    print("| --- | ---: | ---: |")
    for kind in ("f16", *EXPORTED):
        gain = nll[("base", kind)] - nll[("lora", kind)]
        print(f"| llama.cpp {kind} | {nll[('base', kind)]:.4f} | {nll[('lora', kind)]:.4f}, {gain:.4f}, "
              f"**{gain / reference_gain:.3f}** |")
    print("\nseconds a step (median, 2 CPU ranks): " + ", ".join(
        f"{target} {seconds:.2f} ({seconds / step_seconds['none']:.2f}x)" for target, seconds in step_seconds.items()))
    print(f"total {time.time() - started:.0f} s")
    (args.out / "results.json").write_text(json.dumps(
        {"nll": {f"{a}/{b}": v for (a, b), v in nll.items()}, "step_seconds": step_seconds}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
