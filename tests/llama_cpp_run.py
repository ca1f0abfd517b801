"""llama.cpp itself running a GGUF, for the tests: its library (qlora_fsdp/tools/llama_quantize.py's load_llama:
`make llama-quantize`'s prebuilt build) loads the file, tokenizes with the file's own tokenizer and generates greedily,
through ctypes. Run as a subprocess (`python -m tests.llama_cpp_run LIB GGUF PROMPT N [LORA.gguf]`, JSON on stdout),
so that llama.cpp's log and any crash stay out of the test process. A LoRA GGUF is applied at scale 1 as
`llama-cli --lora` applies it (llama_adapter_lora_init, llama_set_adapters_lora).

What is used of llama.h: the model and context are made with llama.cpp's own default params (structs returned by
value into buffers larger than any release's, passed back by value as the last argument: only their head is read);
`llama_batch` (its fields in order: n_tokens, token, embd, pos, n_seq_id, seq_id, logits) from llama_batch_get_one.
"""

from __future__ import annotations

import ctypes as C
import json
import sys
from pathlib import Path

import numpy as np

from qlora_fsdp.tools.llama_quantize import library_file, load_llama


class Defaults(C.Structure):
    _fields_ = [("raw", C.c_uint8 * 1024)]


class Batch(C.Structure):
    _fields_ = [("n_tokens", C.c_int32), ("token", C.c_void_p), ("embd", C.c_void_p), ("pos", C.c_void_p),
                ("n_seq_id", C.c_void_p), ("seq_id", C.c_void_p), ("logits", C.c_void_p)]


def declare(llama: C.CDLL) -> None:
    i32, ptr = C.c_int32, C.c_void_p
    signatures = {
        "llama_model_default_params": ([], Defaults), "llama_context_default_params": ([], Defaults),
        "llama_model_load_from_file": ([C.c_char_p, Defaults], ptr), "llama_init_from_model": ([ptr, Defaults], ptr),
        "llama_model_get_vocab": ([ptr], ptr), "llama_vocab_n_tokens": ([ptr], i32),
        "llama_tokenize": ([ptr, C.c_char_p, i32, C.POINTER(i32), i32, C.c_bool, C.c_bool], i32),
        "llama_batch_get_one": ([C.POINTER(i32), i32], Batch), "llama_decode": ([ptr, Batch], i32),
        "llama_get_logits_ith": ([ptr, i32], C.POINTER(C.c_float)),
        "llama_set_n_threads": ([ptr, i32, i32], None),
        "llama_adapter_lora_init": ([ptr, C.c_char_p], ptr),
        "llama_set_adapters_lora": ([ptr, C.POINTER(ptr), C.c_size_t, C.POINTER(C.c_float)], i32),
    }
    for name, (args, result) in signatures.items():
        getattr(llama, name).argtypes, getattr(llama, name).restype = args, result


def apply_lora(llama: C.CDLL, model: int, context: int, lora: Path | None) -> None:
    """The LoRA GGUF on the context at scale 1 (nothing where `lora` is None)."""
    if lora is None:
        return
    adapter = llama.llama_adapter_lora_init(model, str(lora).encode())
    assert adapter, f"llama.cpp could not load the LoRA {lora}"
    adapters, scales = (C.c_void_p * 1)(adapter), (C.c_float * 1)(1.0)
    assert llama.llama_set_adapters_lora(context, adapters, 1, scales) == 0, "llama_set_adapters_lora failed"


def run(lib_dir: Path, gguf: Path, prompt: str, new_tokens: int, threads: int = 1, lora: Path | None = None) -> dict:
    """The file's tokens for `prompt` (special tokens parsed, no BOS added: a chat template writes its own), the
    logits after it, and `new_tokens` greedy tokens."""
    ggml = C.CDLL(str(library_file(lib_dir, "libggml")), mode=C.RTLD_GLOBAL)
    ggml.ggml_backend_load_all_from_path.argtypes = [C.c_char_p]
    ggml.ggml_backend_load_all_from_path(str(lib_dir).encode())  # the CPU backend best for this CPU
    llama = load_llama(lib_dir)
    declare(llama)
    llama.llama_backend_init()
    model = llama.llama_model_load_from_file(str(gguf).encode(), llama.llama_model_default_params())
    assert model, f"llama.cpp could not load {gguf}"
    context = llama.llama_init_from_model(model, llama.llama_context_default_params())
    llama.llama_set_n_threads(context, threads, threads)  # ggml's threads spin: no more than the cores to spare
    apply_lora(llama, model, context, lora)
    vocab = llama.llama_model_get_vocab(model)
    n_vocab, text = llama.llama_vocab_n_tokens(vocab), prompt.encode()
    ids = (C.c_int32 * (len(text) + 8))()
    count = llama.llama_tokenize(vocab, text, len(text), ids, len(ids), False, True)
    prompt_ids, generated, first_logits = list(ids[:count]), [], None
    batch_ids = (C.c_int32 * count)(*prompt_ids)
    batch = llama.llama_batch_get_one(batch_ids, count)
    for _ in range(new_tokens):
        assert llama.llama_decode(context, batch) == 0, "llama_decode failed"
        logits = np.ctypeslib.as_array(llama.llama_get_logits_ith(context, -1), shape=(n_vocab,))
        first_logits = logits.tolist() if first_logits is None else first_logits
        generated.append(int(logits.argmax()))
        batch_ids = (C.c_int32 * 1)(generated[-1])
        batch = llama.llama_batch_get_one(batch_ids, 1)
    return {"prompt_ids": prompt_ids, "logits": first_logits, "generated": generated}


if __name__ == "__main__":
    lib, file, prompt_text, n, *lora_file = sys.argv[1:]
    print(json.dumps(run(Path(lib), Path(file), prompt_text, int(n), lora=Path(lora_file[0]) if lora_file else None)))
