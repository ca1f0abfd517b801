"""Which llama.cpp type each weight of an exported GGUF gets, as llama-quantize picks it (its llama-quant.cpp, no
importance matrix, no overrides): a file type's default, the tensors a k-quant mix keeps at more bits, and the
fallback for rows that are no multiple of the type's block. Read by training through the export
(`export.target`); tests/test_export_target.py holds it to llama-quantize's own choices.

For the file types `export.target` offers and a dense decoder (the llama-style names below):
- every weight the type's default (q4_K for q4_k_m, q5_K for q5_k_m, q4_0, q8_0);
- the output head, or the token embeddings where the head is tied to them: q6_K (q8_0 for q8_0, and where the row
  is no multiple of the default's block);
- q4_k_m and q5_k_m: attn_v and ffn_down at q6_K in the layers `use_more_bits` names (the first and last eighth,
  every third between);
- rows that are no multiple of 256 take q4_K's, q5_K's and q6_K's fallbacks (q5_0, q5_1, q8_0), then float16.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qlora_fsdp.errors import ConfigError

DEFAULT_TYPES = {"q4_k_m": "q4_K", "q5_k_m": "q5_K", "q4_0": "q4_0", "q8_0": "q8_0"}
BLOCK_SIZES = {"q4_0": 32, "q5_0": 32, "q5_1": 32, "q8_0": 32, "q4_K": 256, "q5_K": 256, "q6_K": 256, "f16": 1}
FALLBACKS = {"q4_K": "q5_0", "q5_K": "q5_1", "q6_K": "q8_0"}
# our modules' last names -> the GGUF tensor's role (llama.cpp's LLM_TENSOR_* names) for llama-style decoders
ROLES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
MORE_BITS_ROLES = ("attn_v", "ffn_down")
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ModelShape:
    """What llama.cpp's choice reads of the model besides a tensor's own name and row length."""

    n_layers: int
    tied_head: bool  # no output.weight: the token embeddings play its part
    llama_70b: bool = False  # llama.cpp's LLM_TYPE_70B (80 layers, grouped-query): attn_v at q5_K, not q4_K


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's layers that keep more bits in a k-quant mix: the first and last eighth, and every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def with_fallback(ggml_type: str, row_length: int, name: str) -> str:
    """The type, or llama.cpp's fallback where the row is no multiple of its block (then float16)."""
    if row_length % BLOCK_SIZES[ggml_type] == 0:
        return ggml_type
    fallback = FALLBACKS.get(ggml_type)
    if fallback is None:
        raise ConfigError(f"export.target: {name} has rows of {row_length}, no multiple of {ggml_type}'s block of "
                          f"{BLOCK_SIZES[ggml_type]}, which llama-quantize refuses; pick another export.target")
    return fallback if row_length % BLOCK_SIZES[fallback] == 0 else "f16"


def role_of(name: str) -> str:
    """The GGUF role of one of our weights (a module name without `.weight`)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("embed_tokens", "lm_head"):
        return {"embed_tokens": "token_embd", "lm_head": "output"}[leaf]
    if leaf not in ROLES or LAYER.search(name) is None:
        raise ConfigError(f"export.target: llama.cpp's type for {name} is not known here (the llama-style names "
                          f"{', '.join(ROLES)} are); set export.target: none")
    return ROLES[leaf]


def tensor_type(target: str, name: str, row_length: int, shape: ModelShape) -> str:
    """The type llama-quantize gives our weight `name` (rows of `row_length`) in a `target` file."""
    default = DEFAULT_TYPES[target]
    role = role_of(name)
    if role == "token_embd" and shape.tied_head:
        role = "output"
    chosen = default
    if role == "output":
        chosen = "q8_0" if default == "q8_0" or row_length % BLOCK_SIZES[default] else "q6_K"
    elif role in MORE_BITS_ROLES and target in ("q4_k_m", "q5_k_m"):
        match = LAYER.search(name)
        assert match is not None
        if use_more_bits(int(match.group(1)), shape.n_layers):
            chosen = "q6_K"
        elif role == "attn_v" and shape.llama_70b and chosen == "q4_K":
            chosen = "q5_K"
    return with_fallback(chosen, row_length, name)
