"""A GGUF's negative log-likelihood of the target tokens of some samples, computed by llama.cpp itself (the libllama
of `make llama-quantize`, through ctypes): each sample in one batch with logits at every position, its memory cleared
between samples. Run as a subprocess, so that llama.cpp's log and any crash stay out of the caller:

    python -m benchmarks.llama_cpp_nll LIB_DIR FILE.gguf SAMPLES.json [LORA.gguf]   # {"nll": ..., "tokens": ...}

SAMPLES.json: a list of {"input_ids": [...], "labels": [...]} (labels -100 where not a target), as training encodes
them, so llama.cpp sees the very token ids training saw (no tokenizer of its own in between).
"""

from __future__ import annotations

import ctypes as C
import json
import math
import sys
from pathlib import Path

import numpy as np

from qlora_fsdp.tools.llama_quantize import library_file, load_llama
from tests.llama_cpp_run import Batch, apply_lora, declare


def declare_batches(llama: C.CDLL) -> None:
    ptr = C.c_void_p
    signatures = {"llama_batch_init": ([C.c_int32, C.c_int32, C.c_int32], Batch), "llama_batch_free": ([Batch], None),
                  "llama_get_memory": ([ptr], ptr), "llama_memory_clear": ([ptr, C.c_bool], None)}
    for name, (args, result) in signatures.items():
        getattr(llama, name).argtypes, getattr(llama, name).restype = args, result


def fill(batch: Batch, input_ids: list[int]) -> None:
    """Every token of one sequence, at its position, logits wanted everywhere."""
    tokens = C.cast(batch.token, C.POINTER(C.c_int32))
    positions = C.cast(batch.pos, C.POINTER(C.c_int32))
    n_seq = C.cast(batch.n_seq_id, C.POINTER(C.c_int32))
    seq_ids = C.cast(batch.seq_id, C.POINTER(C.POINTER(C.c_int32)))
    wanted = C.cast(batch.logits, C.POINTER(C.c_int8))
    for index, token in enumerate(input_ids):
        tokens[index], positions[index], n_seq[index], wanted[index] = token, index, 1, 1
        seq_ids[index][0] = 0
    batch.n_tokens = len(input_ids)


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    peak = float(logits.max())
    return float(logits[token]) - peak - math.log(float(np.exp(logits.astype(np.float64) - peak).sum()))


def nll(lib_dir: Path, gguf: Path, samples: list[dict], lora: Path | None = None) -> dict:
    ggml = C.CDLL(str(library_file(lib_dir, "libggml")), mode=C.RTLD_GLOBAL)
    ggml.ggml_backend_load_all_from_path.argtypes = [C.c_char_p]
    ggml.ggml_backend_load_all_from_path(str(lib_dir).encode())
    llama = load_llama(lib_dir)
    declare(llama)
    declare_batches(llama)
    llama.llama_backend_init()
    model = llama.llama_model_load_from_file(str(gguf).encode(), llama.llama_model_default_params())
    assert model, f"llama.cpp could not load {gguf}"
    context = llama.llama_init_from_model(model, llama.llama_context_default_params())
    llama.llama_set_n_threads(context, 2, 2)
    apply_lora(llama, model, context, lora)
    n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    longest = max(len(sample["input_ids"]) for sample in samples)
    batch = llama.llama_batch_init(longest, 0, 1)
    total, targets = 0.0, 0
    for sample in samples:
        llama.llama_memory_clear(llama.llama_get_memory(context), True)
        fill(batch, sample["input_ids"])
        assert llama.llama_decode(context, batch) == 0, "llama_decode failed"
        for index, label in enumerate(sample["labels"][1:]):
            if label == -100:
                continue
            logits = np.ctypeslib.as_array(llama.llama_get_logits_ith(context, index), shape=(n_vocab,))
            total -= log_softmax_at(logits, label)
            targets += 1
    llama.llama_batch_free(batch)
    return {"nll": total, "tokens": targets}


if __name__ == "__main__":
    lib, file, samples_file, *lora_file = sys.argv[1:]
    print(json.dumps(nll(Path(lib), Path(file), json.loads(Path(samples_file).read_text()),
                         Path(lora_file[0]) if lora_file else None)))
