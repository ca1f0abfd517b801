"""What the After tab says before a merge or an export writes anything: the sizes of the merged checkpoint and of
the GGUF file (tools/export_size.py's estimates from the base's config.json: no weight is read), and whether the
k-quants people run (q4_k_m, q5_k_m) will be written by llama.cpp's quantizer here or only printed as its command."""

from __future__ import annotations

import functools
from pathlib import Path

from qlora_fsdp.tools.export_size import base_config_dir, in_words, parameter_count, size_bytes
from qlora_fsdp.tools.gguf_export import LLAMA_QUANTIZE_TYPES
from qlora_fsdp.tools.llama_quantize import INSTALL_STEP, find_quantizer

# the After tab's GGUF types: the k-quants Ollama and llama.cpp users run first, then what the converter writes
GGUF_TYPES = ("q4_k_m", "q5_k_m", "q6_k", "q8_0", "f16", "bf16", "f32")
MERGE_DTYPE = "bfloat16"  # qlora-merge's default, which the Merge button runs


def default_gguf_type() -> str:
    """q4_k_m where llama.cpp's quantizer is installed (`make` installs it), else f16 (what the converter writes)."""
    return "q4_k_m" if find_quantizer() is not None else "f16"


@functools.lru_cache(maxsize=16)
def base_parameters(adapter: Path, written: float) -> int:
    """The adapter's base model's parameter count (the model built on the meta device: about a second, so kept per
    adapter folder and its training_config.yaml's time)."""
    del written  # the cache key only: a folder written again is read again
    return parameter_count(base_config_dir(adapter))


def sizes_line(adapter: str, outtype: str) -> str:
    """The merge's and the export's sizes, and who writes a k-quant; "" where there is no adapter folder to size."""
    folder = Path(adapter.strip()).expanduser()
    if not (folder / "adapter_config.json").is_file():
        return ""
    try:
        parameters = base_parameters(folder.resolve(), folder.stat().st_mtime)
    except Exception as err:  # the run's own refusal (a base that cannot be found): the tools will say it again
        return f"no size: {err}"
    merged = size_bytes(parameters, MERGE_DTYPE)
    line = (f"Merge writes about {in_words(merged)} ({MERGE_DTYPE}); Export GGUF about "
            f"{in_words(size_bytes(parameters, outtype))} ({outtype})")
    if outtype in LLAMA_QUANTIZE_TYPES:
        line += ", by llama.cpp's quantizer" if find_quantizer() is not None else (
            f": llama.cpp's quantizer is not installed ({INSTALL_STEP}), so the f16 file "
            f"({in_words(size_bytes(parameters, 'f16'))}) is written and its llama-quantize command printed")
    return line + " (estimates from the base's config.json)"
