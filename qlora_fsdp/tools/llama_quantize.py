"""llama.cpp's own quantizer for qlora-export's k-quants (q4_k_m, q5_k_m and the like): an f16 GGUF in, the
quantized GGUF out. No quantizer of ours: llama.cpp does the work, found in this order:

1. a `llama-quantize` binary named by QLORA_LLAMA_QUANTIZE, or on PATH (a llama.cpp built or installed by hand);
2. llama.cpp's shared library (libllama) in QLORA_LLAMA_CPP_LIB, or in .venv/llama-cpp, where `make llama-quantize`
   unpacks the prebuilt CPU build that node-llama-cpp publishes on the npm registry (about 30 MB, seconds: nothing
   is compiled);
3. the libllama that the llama-cpp-python binding built into its package (`pip install llama-cpp-python`, which
   compiles llama.cpp).

A library is called through ctypes in a subprocess (`python -m qlora_fsdp.tools.llama_quantize LIB IN OUT TYPE`),
so its log is captured and a crash in C is a failed export, not a dead process. The call needs two facts of
llama.h: `llama_model_quantize(const char *in, const char *out, const llama_model_quantize_params *)`, and that the
params struct begins with two 32-bit ints, the thread count and the file type; the rest of the struct is taken as
llama.cpp's own defaults give it (`llama_model_quantize_default_params`, into a buffer larger than any version's).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from qlora_fsdp.errors import UserError

QUANTIZE_ENV = "QLORA_LLAMA_QUANTIZE"  # a llama-quantize binary
LIB_ENV = "QLORA_LLAMA_CPP_LIB"  # a folder holding libllama (default: .venv/llama-cpp)
INSTALL_STEP = "make llama-quantize"
# llama.h's `enum llama_ftype`: the file type each quantization writes (LLAMA_FTYPE_MOSTLY_*)
FTYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k_s": 11, "q3_k_m": 12, "q3_k_l": 13,
          "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18, "iq4_nl": 25, "iq4_xs": 30}
PARAMS_BYTES = 1024  # room for llama_model_quantize_params (under 100 bytes in every release so far)


class QuantizeError(UserError, RuntimeError):
    """llama.cpp's quantizer failed; the message is its own last line."""


def default_lib_dir() -> Path:
    return Path(os.environ.get(LIB_ENV) or Path(sys.prefix) / "llama-cpp")


def library_file(folder: Path, stem: str) -> Path | None:
    """`stem`.so in `folder`, or a versioned `stem`.vX.Y.so (npm's build); not libllama-common.so and the like."""
    if not folder.is_dir():
        return None
    found = sorted(path for path in folder.iterdir() if re.fullmatch(rf"{stem}(\.v[0-9.]+)?\.so", path.name))
    return found[0] if found else None


def binding_lib_dir() -> Path | None:
    """The folder of the libllama llama-cpp-python built, found without importing the binding."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "lib"


@dataclass(frozen=True)
class Quantizer:
    binary: Path | None = None  # a llama-quantize executable
    lib_dir: Path | None = None  # or a folder holding libllama

    def describe(self) -> str:
        return str(self.binary) if self.binary else f"libllama in {self.lib_dir}"


def find_quantizer() -> Quantizer | None:
    """llama.cpp's quantizer where one is installed (the order in the module's docstring); None: none is."""
    named = os.environ.get(QUANTIZE_ENV)
    binary = Path(named) if named else (Path(found) if (found := shutil.which("llama-quantize")) else None)
    if binary is not None and binary.is_file():
        return Quantizer(binary=binary)
    for folder in (default_lib_dir(), binding_lib_dir()):
        if folder is not None and library_file(folder, "libllama") is not None:
            return Quantizer(lib_dir=folder)
    return None


def quantize(quantizer: Quantizer, source: Path, target: Path, outtype: str) -> float:
    """Write `target`, `source` (an f16 GGUF) quantized to `outtype` by llama.cpp; the seconds it took."""
    if outtype not in FTYPES:
        raise QuantizeError(f"llama.cpp's quantizer has no type {outtype!r} here (known: {', '.join(FTYPES)})")
    if quantizer.binary is not None:
        command = [str(quantizer.binary), str(source), str(target), outtype.upper()]
    else:
        command = [sys.executable, "-m", "qlora_fsdp.tools.llama_quantize", str(quantizer.lib_dir), str(source),
                   str(target), outtype]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, errors="replace")
    if done.returncode != 0 or not target.is_file():
        lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        raise QuantizeError(f"llama.cpp's quantizer ({quantizer.describe()}) failed: "
                            f"{lines[-1] if lines else f'exit status {done.returncode}'}")
    return time.perf_counter() - started


def load_llama(lib_dir: Path) -> ctypes.CDLL:
    """libllama from `lib_dir`, its ggml loaded first and globally (so its compute backends can be loaded too)."""
    ggml = library_file(lib_dir, "libggml")
    if ggml is not None:
        ctypes.CDLL(str(ggml), mode=ctypes.RTLD_GLOBAL)
    llama = library_file(lib_dir, "libllama")
    if llama is None:
        raise QuantizeError(f"no libllama in {lib_dir}: run {INSTALL_STEP}")
    return ctypes.CDLL(str(llama))


class QuantizeParams(ctypes.Structure):
    _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int32),
                ("rest", ctypes.c_uint8 * (PARAMS_BYTES - 8))]


def quantize_with_library(lib_dir: Path, source: Path, target: Path, outtype: str) -> None:
    """llama_model_quantize of `lib_dir`'s libllama, in this process (the subprocess `quantize` starts)."""
    llama = load_llama(lib_dir)
    llama.llama_backend_init()
    llama.llama_model_quantize_default_params.restype = QuantizeParams
    llama.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(QuantizeParams)]
    llama.llama_model_quantize.restype = ctypes.c_uint32
    params = llama.llama_model_quantize_default_params()
    params.ftype = FTYPES[outtype]
    status = llama.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        raise QuantizeError(f"llama_model_quantize returned {status} for {source}")


def main(argv: list[str] | None = None) -> int:
    lib_dir, source, target, outtype = (sys.argv[1:] if argv is None else argv)
    try:
        quantize_with_library(Path(lib_dir), Path(source), Path(target), outtype)
    except QuantizeError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
