"""llama.cpp's own quantizer and dequantizer for the tests, through ctypes: `ggml_quantize_chunk` (what llama-quantize
calls for every tensor; no importance matrix) and `dequantize_row_*` of the libggml-base that `make llama-quantize`
installs. The reference qlora_fsdp/gguf_target/quantizers.py is held to."""

from __future__ import annotations

import ctypes as C
from functools import cache

import numpy as np
import torch

from qlora_fsdp.tools.llama_quantize import default_lib_dir, library_file

# ggml.h's enum ggml_type (stable across releases)
GGML_TYPES = {"q4_0": 2, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_K": 12, "q5_K": 13, "q6_K": 14}


@cache
def libggml() -> C.CDLL | None:
    path = library_file(default_lib_dir(), "libggml-base")
    if path is None:
        return None
    lib = C.CDLL(str(path))
    lib.ggml_quantize_chunk.argtypes = [C.c_int, C.c_void_p, C.c_void_p, C.c_int64, C.c_int64, C.c_int64, C.c_void_p]
    lib.ggml_quantize_chunk.restype = C.c_size_t
    lib.ggml_row_size.argtypes = [C.c_int, C.c_int64]
    lib.ggml_row_size.restype = C.c_size_t
    return lib


def quantized_bytes(w: torch.Tensor, ggml_type: str) -> np.ndarray:
    """llama.cpp's blocks for the rows of `w` (float32, [rows, n])."""
    lib = libggml()
    assert lib is not None, "no libggml-base: make llama-quantize"
    rows, n = w.shape
    source = np.ascontiguousarray(w.float().numpy())
    kind = GGML_TYPES[ggml_type]
    out = np.zeros(rows * lib.ggml_row_size(kind, n), dtype=np.uint8)
    lib.ggml_quantize_init(kind)
    lib.ggml_quantize_chunk(kind, source.ctypes.data, out.ctypes.data, 0, rows, n, None)
    return out


def dequantized(blocks: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> torch.Tensor:
    """llama.cpp's own dequantization of its blocks."""
    lib = libggml()
    assert lib is not None
    out = np.zeros(shape, dtype=np.float32)
    getattr(lib, f"dequantize_row_{ggml_type}")(C.c_void_p(blocks.ctypes.data), C.c_void_p(out.ctypes.data),
                                                C.c_int64(out.size))
    return torch.from_numpy(out)


def llama_cpp_rounded(w: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """`w` quantized and read back by llama.cpp itself."""
    return dequantized(quantized_bytes(w, ggml_type), ggml_type, tuple(w.shape))
