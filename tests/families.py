"""Tiny random models of the decoder families people fine-tune, saved as transformers saves them.

Each has hidden size 64, 2 layers and our tiny tokenizer; where the family has sliding windows they are 16 tokens,
shorter than the rows the tests use, so a kernel that ignores them gives another loss. The family's own quirks are
switched on where a default would hide them: Gemma's query_pre_attn_scalar differs from the head size, Gemma 2
soft-caps, the full-attention layers of Gemma 3 scale their rotary positions, Qwen2 turns its window on, biases
(Qwen2's projections, gpt-oss's experts and router) are not zero.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

WINDOW = 16
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)


def _tokens(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    return dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def _config(model_type: str, tokenizer: PreTrainedTokenizerFast, **extra: Any) -> PretrainedConfig:
    return AutoConfig.for_model(model_type, **{**SMALL, **_tokens(tokenizer), **extra})


def _gemma3_text(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    return dict(**SMALL, **_tokens(tokenizer), head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})


def gemma3_multimodal(tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """Gemma 3 4B-27B's layout: a SigLIP vision tower, a projector, the decoder under `language_model`."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=Gemma3TextConfig(**_gemma3_text(tokenizer)), vision_config=vision,
                          mm_tokens_per_image=4, image_token_index=tokenizer.unk_token_id,
                          boi_token_index=tokenizer.bos_token_id, eoi_token_index=tokenizer.eos_token_id,
                          architectures=["Gemma3ForConditionalGeneration"])
    return config


def llama4_multimodal(tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """Llama 4 Scout's and Maverick's checkpoints: the text model (`language_model.model.`, its head
    `language_model.lm_head.`) beside a vision model and a projector."""
    from transformers import Llama4Config, Llama4VisionConfig

    vision = Llama4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                                projector_output_dim=32)
    text = MOE_FAMILIES["llama4"](tokenizer)
    return Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                        image_token_index=tokenizer.unk_token_id, architectures=["Llama4ForConditionalGeneration"])


GEMMA4 = dict(head_dim=16, global_head_dim=32, sliding_window=WINDOW, hidden_size_per_layer_input=8,
              layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0)
# DeepSeek-V3's multi-head latent attention: queries and keys+values through low-rank projections (q_a/q_b, kv_a/kv_b)
MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
           num_key_value_heads=4)
# a shared expert beside 4 routed ones, the first layer dense, routing corrected by a persistent fp32 buffer
DEEPSEEK_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32)


FAMILIES: dict[str, Callable[[PreTrainedTokenizerFast], PretrainedConfig]] = {
    "llama": lambda tok: _config("llama", tok),
    "qwen2": lambda tok: _config("qwen2", tok, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                 tie_word_embeddings=True),
    "qwen3": lambda tok: _config("qwen3", tok, head_dim=16, tie_word_embeddings=True),
    "qwen3_5": lambda tok: _config("qwen3_5_text", tok, head_dim=16, linear_key_head_dim=16,
                                   linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                   layer_types=["linear_attention", "full_attention"], tie_word_embeddings=True),
    "mistral": lambda tok: _config("mistral", tok, head_dim=16, sliding_window=WINDOW),
    "gemma2": lambda tok: _config("gemma2", tok, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                  attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3": lambda tok: AutoConfig.for_model("gemma3_text", **_gemma3_text(tok)),
    "gemma3_multimodal": gemma3_multimodal,
    "phi3": lambda tok: _config("phi3", tok),
    "olmo2": lambda tok: _config("olmo2", tok),
    # Seed-OSS: biased q, k and v; its dropouts (0.1 as shipped) off here, so one step's gradients can equal PEFT's
    # (tests/test_attention.py holds the attention dropout to transformers' under one seed)
    "seed_oss": lambda tok: _config("seed_oss", tok, head_dim=16, attention_dropout=0.0, residual_dropout=0.0),
    # Gemma 4: per-layer inputs (a second embedding, gated into every layer), wider heads and proportional rotary in
    # its full-attention layers, a persistent `layer_scalar` buffer in every layer, soft-capped logits
    "gemma4": lambda tok: _config("gemma4_text", tok, **GEMMA4, vocab_size_per_layer_input=len(tok)),
}


# mixtures of experts: 4 experts, 2 a token; Qwen3-MoE and Mixtral saved one tensor an expert, gpt-oss fused
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
MOE_FAMILIES: dict[str, Callable[[PreTrainedTokenizerFast], PretrainedConfig]] = {
    "qwen3_moe": lambda tok: _config("qwen3_moe", tok, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=32),
    "mixtral": lambda tok: _config("mixtral", tok, head_dim=16, **MOE),
    "gpt_oss": lambda tok: _config("gpt_oss", tok, head_dim=16, sliding_window=WINDOW, **MOE,
                                   layer_types=["sliding_attention", "full_attention"]),
    # Qwen3.5-35B-A3B's shape: Gated DeltaNet beside full attention, routed experts beside a gated shared expert
    "qwen3_5_moe": lambda tok: _config("qwen3_5_moe_text", tok, head_dim=16, linear_key_head_dim=16,
                                       linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                       layer_types=["linear_attention", "full_attention"], num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=64, tie_word_embeddings=True),
    # Qwen3-Next-80B-A3B's shape (the same layer kinds, untied)
    "qwen3_next": lambda tok: _config("qwen3_next", tok, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                                      linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                                      layer_types=["linear_attention", "full_attention"], num_experts_per_tok=2,
                                      moe_intermediate_size=32, shared_expert_intermediate_size=64),
    # Gemma 4 26B-A4B's shape: a routed-experts block beside each layer's dense MLP, no per-layer inputs, the
    # full-attention layers' values their keys (attention_k_eq_v: no v_proj there) with fewer key heads
    "gemma4_moe": lambda tok: _config("gemma4_text", tok, **{**GEMMA4, "hidden_size_per_layer_input": 0},
                                      attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True,
                                      num_experts=4, top_k_experts=2, moe_intermediate_size=32),
    "glm4_moe": lambda tok: _config("glm4_moe", tok, head_dim=16, **DEEPSEEK_MOE, first_k_dense_replace=1, n_group=1,
                                    topk_group=1),  # GLM-4.5/4.6/4.7
    "deepseek_v3": lambda tok: _config("deepseek_v3", tok, **MLA, **DEEPSEEK_MOE, first_k_dense_replace=1, n_group=1,
                                       topk_group=1),  # Kimi K2, Moonlight
    "glm4_moe_lite": lambda tok: _config("glm4_moe_lite", tok, **MLA, **DEEPSEEK_MOE,
                                         mlp_layer_types=["dense", "sparse"]),  # GLM-4.7-Flash: MLA and experts
    # Llama 4 Scout's layer kinds: chunked attention with rotary, then a layer without (NoPE); experts stored
    # [E, hidden, 2*inner], called with every expert's rows scaled by a sigmoid router (top-1); Maverick's dense
    # layer between the MoE ones
    "llama4": lambda tok: _config("llama4_text", tok, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                                  intermediate_size=32, intermediate_size_mlp=128, attention_chunk_size=WINDOW,
                                  layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0],
                                  moe_layers=[1]),
    "llama4_multimodal": llama4_multimodal,
}


def write_family_model(out: Path, family: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Path:
    """Build the family's tiny model with seeded random weights and save it (bf16, as the hub ships them)."""
    config = {**FAMILIES, **MOE_FAMILIES}[family](tokenizer)
    torch.manual_seed(seed)
    if family.endswith("multimodal"):
        from qlora_fsdp.families import full_model_class

        model: torch.nn.Module = full_model_class(config)(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # transformers starts biases at zero, where a dropped bias would go unnoticed
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_mxfp4_copy(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """gpt-oss as OpenAI ships it: every experts parameter as MXFP4 blocks and scales (random 4-bit values and
    powers of two near 1/16 here), `quantization_config` naming mxfp4."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    tensors, generator = load_file(out / "model.safetensors"), torch.Generator().manual_seed(seed)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        n_experts, n_in, n_out = tensors.pop(key).shape  # gpt-oss keeps x @ W's W: [experts, in, out]
        tensors[f"{key}_blocks"] = torch.randint(0, 256, (n_experts, n_out, n_in // 32, 16), dtype=torch.uint8,
                                                 generator=generator)
        tensors[f"{key}_scales"] = torch.randint(121, 125, (n_experts, n_out, n_in // 32), dtype=torch.uint8,
                                                 generator=generator)
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
