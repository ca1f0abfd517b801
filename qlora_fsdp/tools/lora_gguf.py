"""An adapter as llama.cpp's LoRA GGUF (`qlora-export --lora-only`): llama.cpp and Ollama (a Modelfile's ADAPTER)
apply it over a base GGUF of their own, a quantized one included, with no merge and no full-size file.

The adapter's pairs are named as the base checkpoint names its weights and handed to lora_gguf_writer.py, which
runs under llama.cpp's converter (its own `gguf`, as gguf_export.py explains) and names and orders them as the base's
GGUF does. llama.cpp scales each update by adapter.lora.alpha / r; the file's alpha is PEFT's scaling times r, so an
rsLoRA adapter keeps its alpha / sqrt(r). What a LoRA file cannot hold is refused in one line: DoRA's magnitudes,
tensors trained in full, per-module ranks or alphas.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from qlora_fsdp.layers.lora_math import lora_scale
from qlora_fsdp.loading.adapter import read_adapter
from qlora_fsdp.loading.names import PEFT_PREFIX
from qlora_fsdp.tools.gguf_export import ConverterRun, GgufExportError, converter_env, converter_reason

LORA_OUTTYPES = ("f32", "f16")  # a LoRA file is small: no quantized types
LORA_PARTS = (".lora_A.weight", ".lora_B.weight")
MERGE_INSTEAD = "export the merged model instead (qlora-export without --lora-only)"


@dataclass
class LoraPairs:
    pairs: dict[str, torch.Tensor]  # `<checkpoint weight name>.lora_a` / `.lora_b`, float32
    alpha: float  # llama.cpp's adapter.lora.alpha: its scale alpha / r is PEFT's scaling


def lora_pairs(adapter_dir: Path) -> LoraPairs:
    """The adapter's LoRA pairs by the base checkpoint's weight names, refused where a LoRA GGUF cannot hold it."""
    config, tensors = read_adapter(adapter_dir)
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise GgufExportError(f"{adapter_dir}: per-module ranks or alphas (rank_pattern, alpha_pattern); llama.cpp "
                              f"scales a LoRA file by one alpha: {MERGE_INSTEAD}")
    other = next((key for key in tensors if not key.endswith(LORA_PARTS)), None)
    if config.get("use_dora") or other is not None:
        what = "DoRA's magnitudes" if config.get("use_dora") else f"'{other}', trained in full or not LoRA"
        raise GgufExportError(f"{adapter_dir} holds {what}, which a LoRA GGUF cannot carry: {MERGE_INSTEAD}")
    pairs = {}
    for key in tensors:
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            name = module.removeprefix(PEFT_PREFIX) + ".weight"
            pairs[f"{name}.lora_a"] = tensors[key].float().contiguous()
            pairs[f"{name}.lora_b"] = tensors[f"{module}.lora_B.weight"].float().contiguous()
    if not pairs:
        raise GgufExportError(f"{adapter_dir} holds no LoRA weights")
    rank = int(config["r"])
    scaling = lora_scale(rank, config["lora_alpha"], bool(config.get("use_rslora")))
    return LoraPairs(pairs, scaling * rank)


def write_lora_gguf(adapter_dir: Path, base_folder: Path, out_file: Path, outtype: str, work: Path) -> ConverterRun:
    """The adapter as a LoRA GGUF at `out_file`, named after the base (`base_folder`: a staged folder whose
    config.json names the architecture), through llama.cpp's converter."""
    lora = lora_pairs(adapter_dir)
    pairs_file = work / "lora_pairs.safetensors"
    save_file(lora.pairs, pairs_file)
    started = time.perf_counter()
    command = [sys.executable, str(Path(__file__).with_name("lora_gguf_writer.py")), str(base_folder),
               str(pairs_file), repr(lora.alpha), outtype, str(out_file)]
    done = subprocess.run(command, env=converter_env(), capture_output=True, text=True)
    pairs_file.unlink()
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise GgufExportError(f"writing {adapter_dir} as a LoRA GGUF failed: {converter_reason(log)}")
    return ConverterRun(time.perf_counter() - started, log)


def field_text(reader: object, key: str) -> str | None:
    field = reader.fields.get(key)  # type: ignore[attr-defined]
    return None if field is None else bytes(field.parts[field.data[0]]).decode()


def check_base_gguf(base_gguf: Path, lora_file: Path) -> None:
    """The base GGUF the user names holds every tensor the LoRA file changes, at its shape, for the same
    architecture (llama.cpp would refuse it only when it loads)."""
    from gguf import GGUFReader

    if not base_gguf.is_file():
        raise GgufExportError(f"--base-gguf {base_gguf} is not a file")
    base, lora = GGUFReader(base_gguf), GGUFReader(lora_file)
    base_arch, lora_arch = field_text(base, "general.architecture"), field_text(lora, "general.architecture")
    if base_arch != lora_arch:
        raise GgufExportError(f"--base-gguf {base_gguf} is a {base_arch} model; the adapter is for {lora_arch}")
    shapes = {tensor.name: [int(n) for n in tensor.shape] for tensor in base.tensors}
    adapter = {tensor.name: [int(n) for n in tensor.shape] for tensor in lora.tensors}
    for name in sorted(name.removesuffix(".lora_a") for name in adapter if name.endswith(".lora_a")):
        wanted = [adapter[f"{name}.lora_a"][0], adapter[f"{name}.lora_b"][1]]  # ggml's order: [in, out]
        if shapes.get(name) != wanted:
            found = "no such tensor" if name not in shapes else f"{name} of {shapes[name]}"
            raise GgufExportError(f"--base-gguf {base_gguf} is not this adapter's base: {name} should be "
                                  f"{wanted} (in, out), it has {found}")
