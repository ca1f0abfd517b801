"""How large a merged checkpoint or GGUF file will be, before it is written: the base model's parameter count (from its
config.json alone, the model built on the meta device: no weights read) times the bytes an element takes in the
output type. An estimate: a GGUF adds its tokenizer and metadata (a few MB), and a k-quant's tensors whose rows are
not a multiple of 256 wide fall back to a larger type (a small model's file is then well above the estimate; a
released model's widths are multiples of 256).
"""

from __future__ import annotations

from pathlib import Path

# bits per weight of each output type. The plain ones are their element sizes; q8_0 and the legacy quants are their
# block layouts (32 weights with a float16 scale, and an offset for _1); the k-quants' mixes put some tensors in a
# larger type than their name says, and llama.cpp's own k-quant figures, measured on LLaMA 7B, are 4.85 bits per
# weight for Q4_K_M and 5.69 for Q5_K_M. The other k-quants: their main type's block layout (super-blocks of 256),
# which a mix runs a little above
BITS_PER_WEIGHT = {
    "float32": 32.0, "f32": 32.0, "float16": 16.0, "f16": 16.0, "bfloat16": 16.0, "bf16": 16.0,
    "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "iq4_nl": 4.5, "iq4_xs": 4.25,
    "q2_k": 2.625, "q3_k_s": 3.4375, "q3_k_m": 3.4375, "q3_k_l": 3.4375, "q4_k_s": 4.5, "q4_k_m": 4.85,
    "q5_k_s": 5.5, "q5_k_m": 5.69, "q6_k": 6.5625,
}


def parameter_count(model_dir: Path) -> int:
    """The parameters of the checkpoint `model_dir`'s config.json describes (a tied head counted once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qlora_fsdp.errors import ModelLoadError
    from qlora_fsdp.loading.layout import meta_full_model

    config = AutoConfig.from_pretrained(model_dir)
    try:
        model = meta_full_model(config)
    except ModelLoadError:  # no `architectures` (a folder converted from a GGUF): its model_type's causal LM
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    return sum(param.numel() for param in model.parameters())


def size_bytes(parameters: int, outtype: str) -> int:
    """`parameters` weights written as `outtype` (f16, q4_k_m, bfloat16...), in bytes."""
    if outtype.lower() not in BITS_PER_WEIGHT:
        raise ValueError(f"no size known for {outtype!r} (known: {', '.join(BITS_PER_WEIGHT)})")
    return round(parameters * BITS_PER_WEIGHT[outtype.lower()] / 8)


def checkpoint_size_bytes(model_dir: Path, outtype: str) -> int:
    """The size of `model_dir`'s checkpoint written as `outtype` (a merged folder exported as it is)."""
    return size_bytes(parameter_count(model_dir), outtype)


def base_config_dir(adapter_dir: Path, recipe: str | None = None, overrides: list[str] | None = None) -> Path:
    """The folder holding the adapter's base model's config.json: the repo's shipped copy for a hub name (no
    download), else model.path's folder."""
    from qlora_fsdp.loading.adapter import config_for_adapter
    from qlora_fsdp.loading.checkpoint import model_dir, shipped_config_folder

    cfg = config_for_adapter(adapter_dir, recipe, overrides or [])
    return shipped_config_folder(cfg) or model_dir(cfg)


def merged_size_bytes(adapter_dir: Path, outtype: str, recipe: str | None = None,
                      overrides: list[str] | None = None) -> int:
    """The size of the adapter merged into its base and written as `outtype`: a GGUF type (f16, q8_0, q4_k_m...) or
    a merge dtype (bfloat16, float16, float32). The LoRA matrices add nothing: a merge folds them into the base's."""
    return checkpoint_size_bytes(base_config_dir(adapter_dir, recipe, overrides), outtype)


def in_words(size: int) -> str:
    """A size as a person reads it: 1.4 MB, 512 MB, 1.4 GB."""
    if size >= 1e9:
        return f"{size / 1e9:.1f} GB"
    return f"{size / 1e6:.0f} MB" if size >= 1e7 else f"{size / 1e6:.1f} MB"
