"""The export rounding's Triton kernels compiled for a CUDA GPU here, on the CPU (Triton ships its own ptxas), and
the float32 instructions their PTX holds: what decides whether they equal the torch rounding on a device.

    TRITON_INTERPRET=0 python -m tests.kernel_ptx     # one JSON line: {configuration: [float32 instructions]}

Run with the interpreter off (the tests' conftest turns it on, and `triton.jit` decides at import).
`--fusion` compiles the q4_K rounding with Triton's default (fused multiply-adds allowed): the check's positive
control.
"""

from __future__ import annotations

import json
import re
import sys

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from qlora_fsdp.kernels import export_rounding as kernels

ARCH = 90  # H100's sm_90; the instructions chosen do not depend on it
ROUNDING = {"out_ptr": "*i16", "base_ptr": "*bf16", "product_ptr": "*fp32", "scale": "fp32", "d_ptr": "*fp16",
            "scales_ptr": "*i8", "dmin_ptr": "*fp16", "mins_ptr": "*i8", "n_blocks": "i32"}
SEARCH_WITH_MIN = {"x_ptr": "*fp32", "candidates_ptr": "*fp32", "d_ptr": "*fp16", "ls_ptr": "*i8",
                   "dmin_ptr": "*fp16", "lm_ptr": "*i8", "n_blocks": "i32"}
SEARCH_Q6_K = {"x_ptr": "*fp32", "candidates_ptr": "*fp32", "d_ptr": "*fp16", "sc_ptr": "*i8", "n_blocks": "i32"}
FLOAT_OPS = re.compile(r"\b(?:add|sub|mul|div|sqrt|rcp|fma|mad|cvt)\.[a-z0-9.]*f(?:16|32)[a-z0-9.]*")


def configurations() -> dict[str, tuple[object, dict[str, str], dict[str, object]]]:
    found: dict[str, tuple[object, dict[str, str], dict[str, object]]] = {}
    for ggml_type, (kind, block, number) in kernels.KINDS.items():
        constants = {"KIND": kind, "HAS_PRODUCT": True, "BS": block, "NUMBER": number, "BP": kernels.BLOCKS_A_PROGRAM,
                     "BF16_BITS": True}
        found[f"rounding {ggml_type}"] = (kernels.export_rounding_kernel, ROUNDING, constants)
    for ggml_type, nmax, nstep in (("q4_K", 15, 20), ("q5_K", 31, 15)):
        found[f"search {ggml_type}"] = (kernels.with_min_search_kernel, SEARCH_WITH_MIN,
                                        {"NMAX": nmax, "NSTEP": nstep, "BP": kernels.BLOCKS_A_PROGRAM})
    found["search q6_K"] = (kernels.q6_k_search_kernel, SEARCH_Q6_K,
                            {"N_CANDIDATES": 18, "BP": kernels.BLOCKS_A_PROGRAM})
    return found


def float_instructions(kernel: object, signature: dict[str, str], constants: dict[str, object],
                       fusion: bool) -> list[str]:
    source = ASTSource(fn=kernel, signature=signature | dict.fromkeys(constants, "constexpr"), constexprs=constants)
    options = kernels.LAUNCH_OPTIONS if not fusion else {}  # the options every launch passes, or Triton's defaults
    compiled = compile(source, target=GPUTarget("cuda", ARCH, 32), options=options)
    return sorted(set(FLOAT_OPS.findall(compiled.asm["ptx"])))


def main() -> None:
    fusion = "--fusion" in sys.argv[1:]
    chosen = {name: parts for name, parts in configurations().items() if not fusion or name == "rounding q4_K"}
    print(json.dumps({name: float_instructions(*parts, fusion) for name, parts in chosen.items()}))


if __name__ == "__main__":
    main()
