"""What differs between model families, in one place: the rest of the package asks these functions and never tests
a family's name itself.

- **Multimodal checkpoints** (Gemma 3 4B-27B, Mistral 3): trained as their text model (`text_config`); with
  images in the records only where that is checked (LLaVA, Gemma 3), the others refused in one line saying why.
- **Attention**: what a family's attention adds to causal attention (sliding windows, soft-capping, sinks) and
  whether transformers' sdpa can run it.
- **Logits**: families that soft-cap the head's output inside their forward (Gemma 2).
- **Stored forms**: MXFP4 is stored by gpt-oss on its experts only.
- **Tiny models**: which families tie the head to the embeddings in their small sizes (the tiny models copy it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from qlora_fsdp.errors import ConfigError, ModelLoadError

# families whose attention adds a learned logit per head to every softmax (transformers' `s_aux`)
SINK_FAMILIES = {"gpt_oss"}


def is_multimodal(config: PretrainedConfig) -> bool:
    """A vision-language checkpoint whose language model is a decoder of its own (`text_config`)."""
    sub_configs = getattr(config, "sub_configs", {}) or {}
    return "text_config" in sub_configs and "vision_config" in sub_configs


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config training builds a causal LM from: the text model's for a multimodal checkpoint."""
    if not is_multimodal(config):
        return config
    text = config.get_text_config()
    if type(text) not in AutoModelForCausalLM._model_mapping:
        raise ModelLoadError(f"{config.model_type}: its language model ({text.model_type}) is not a causal LM "
                             "transformers can build on its own; this multimodal family is not supported yet")
    return text


@dataclass(frozen=True)
class ImageFamily:
    """A vision-language family whose training with images is checked against transformers (tests/test_vision.py):
    the image features go in at the image tokens of the decoder."""

    name: str
    # where an image's tokens attend to each other both ways (Gemma 3): the module of transformers' own mask builder
    both_ways_masks: str | None = None
    grid_positions: bool = False  # rotary positions over 3 axes, an image's from its grid (Qwen-VL's get_rope_index)
    cross_attention: bool = False  # the text reads the images through cross-attention layers (Llama 3.2 Vision)
    # the projector's modules in the base model (what lora.train_projector trains); the rest of the image side is
    # the vision tower
    projector: tuple[str, ...] = ("multi_modal_projector",)

    @property
    def dynamic_resolution(self) -> bool:
        """Images keep their aspect and become as many tokens as their pixels make (a budget applies): Qwen-VL."""
        return self.grid_positions


IMAGE_FAMILIES = {"llava": ImageFamily("LLaVA"),
                  "gemma3": ImageFamily("Gemma 3", both_ways_masks="transformers.models.gemma3.modeling_gemma3"),
                  "qwen2_5_vl": ImageFamily("Qwen2.5-VL", grid_positions=True, projector=("visual.merger",)),
                  "qwen3_vl": ImageFamily("Qwen3-VL", grid_positions=True,
                                          projector=("visual.merger", "visual.deepstack_merger_list")),
                  "mllama": ImageFamily("Llama 3.2 Vision", cross_attention=True)}
IMAGES_NOT_YET = {  # what the others need, said when their records show images
    "qwen2_vl": "its vision tower is not checked yet (Qwen2.5-VL's is)",
    "qwen3_vl_moe": "its mixture-of-experts decoder with images is not checked yet (Qwen3-VL's dense one is)",
}


def check_images_supported(config: PretrainedConfig) -> None:
    """Records with images train only where the loss is checked against transformers: never a different loss."""
    if config.model_type in IMAGE_FAMILIES:
        return
    why = IMAGES_NOT_YET.get(config.model_type, "it is not checked against transformers yet")
    families = ", ".join(family.name for family in IMAGE_FAMILIES.values())
    raise ModelLoadError(f"records with images are not supported for {config.model_type} yet: {why}; train it on "
                         f"text records, or use a checkpoint of {families}")


def check_images_split(config: PretrainedConfig, degree: int) -> None:
    """Images in rows split over ranks (context parallel) train where each rank can take what its own image tokens
    need (LLaVA's features; Qwen-VL's grid positions, from the whole row's ids, and deepstack rows). One line for
    the others."""
    family = IMAGE_FAMILIES.get(config.model_type)
    if degree == 1 or family is None:
        return
    needs = ("its image tokens attend to each other both ways, masks over the whole row" if family.both_ways_masks
             else "its text reads the images in cross-attention layers" if family.cross_attention else None)
    if needs is not None:
        raise ConfigError(f"'fsdp.context_parallel: {degree}' with images of {family.name}: {needs}, which a split "
                          "row is not built for yet; use fsdp.context_parallel: 1")


def full_model_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The checkpoint's own architecture (config.json's `architectures`), as transformers would load it."""
    import transformers

    names = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, names[0], None) if names else None
    if model_class is None:
        raise ModelLoadError(f"{config.model_type}: config.json names no architecture transformers has ({names})")
    return model_class


@dataclass(frozen=True)
class AttentionNeeds:
    """What a family's attention needs of a kernel (families.attention_needs reads it from the config)."""

    family: str = "llama"
    softcap: bool = False  # Gemma 2's attn_logit_softcapping
    sinks: bool = False  # gpt-oss
    sdpa: bool = True  # transformers runs this family under sdpa
    windowed: bool = False  # sliding-window layers (Mistral, Gemma 2 and 3, gpt-oss)
    dropout: float = 0.0  # config.json's attention_dropout, applied in training (Seed-OSS ships 0.1)
    chunked: bool = False  # Llama 4's chunked-attention layers: a query sees its own chunk of the sample only
    # Llama 4's layers without rotary scale their queries by the position in the row from this position on
    # (attn_temperature_tuning, floor_scale), whatever sample of a packed row the token belongs to
    row_position_scaling_from: int | None = None

    @property
    def sdpa_exact(self) -> bool:
        """transformers' sdpa computes this family's attention (its masks carry windows, not caps or sinks)."""
        return self.sdpa and not (self.softcap or self.sinks)


CAUSAL_ONLY = AttentionNeeds()  # plain causal attention (Llama): what a kernel is asked when no family is named


def attention_needs(config: PretrainedConfig) -> AttentionNeeds:
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return AttentionNeeds(
        family=config.model_type,
        softcap=getattr(config, "attn_logit_softcapping", None) is not None,
        sinks=config.model_type in SINK_FAMILIES,
        sdpa=bool(getattr(model_class, "_supports_sdpa", True)),
        windowed=getattr(config, "sliding_window", None) is not None,
        dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
        chunked="chunked_attention" in (getattr(config, "layer_types", None) or []),
        row_position_scaling_from=row_position_scaling_from(config),
    )


def row_position_scaling_from(config: PretrainedConfig) -> int | None:
    """Llama 4: with attn_temperature_tuning its NoPE layers (no_rope_layers 0) multiply a query by
    1 + attn_scale * log1p(floor((p + 1) / floor_scale)), p its index in the row: 1 below floor_scale - 1."""
    if not getattr(config, "attn_temperature_tuning", False) or all(getattr(config, "no_rope_layers", None) or [1]):
        return None
    return int(config.floor_scale) - 1


def softcaps_logits(config: PretrainedConfig | None) -> bool:
    """Gemma 2 transforms the head's output inside its forward (final logit soft-capping)."""
    return getattr(config, "final_logit_softcapping", None) is not None


def quant_method(config: PretrainedConfig | None) -> str | None:
    """config.json's quantization_config.quant_method (a dict, or transformers' config object), if any."""
    quantization = getattr(config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    return getattr(quantization, "quant_method", None) if method is None else method


def refuse_mxfp4_dense(config: PretrainedConfig, has_experts: bool) -> None:
    """MXFP4 is trained from where gpt-oss uses it, on the experts (decoded, then NF4); not on dense weights."""
    if quant_method(config) == "mxfp4" and not has_experts:
        raise ModelLoadError(f"{config.model_type}: config.json says its weights are stored in MXFP4 and it has no "
                             "experts: MXFP4 dense weights are not supported; use the unquantized checkpoint")


def small_models_tie_embeddings(model_type: str) -> bool:
    """Qwen's small models tie the head to the embeddings (Llama 3.2 and Gemma too, but not our tiny ones)."""
    return model_type.startswith("qwen")


# a config's model_type as people name the family (another model_type is shown as it is)
FAMILY_NAMES = {
    "llama": "Llama", "qwen2": "Qwen2.5", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE (MoE)", "qwen3_5": "Qwen3.5",
    "qwen3_5_moe": "Qwen3.5-MoE (MoE)", "mistral": "Mistral", "mixtral": "Mixtral (MoE)", "gemma2": "Gemma 2",
    "gemma3": "Gemma 3", "gemma3_text": "Gemma 3", "phi3": "Phi-3", "olmo2": "OLMo 2", "gpt_oss": "gpt-oss (MoE)",
    "qwen2_5_vl_text": "Qwen2.5-VL", "qwen3_vl_text": "Qwen3-VL", "mllama_text_model": "Llama 3.2 Vision",
}


def family_name(model_type: str) -> str:
    """A config's model_type as people name the family (the recipe table's column)."""
    return FAMILY_NAMES.get(model_type, model_type)


def router_loss_coefficient(config: PretrainedConfig | None, grpo: bool = False) -> float | None:
    """A mixture of experts' load-balancing coefficient where training adds the loss, else None: where the config
    asks (`output_router_logits`); under GRPO (TRL 1.16's rule) wherever the config has the switch at all, even
    false, and a non-zero `router_aux_loss_coef`."""
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    coefficient = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
    if grpo:
        return coefficient if hasattr(text, "output_router_logits") and coefficient else None
    return coefficient if getattr(text, "output_router_logits", False) else None


# the config key a family names its experts per token by (Gemma 4: top_k_experts; most: num_experts_per_tok)
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "top_k_experts", "moe_top_k", "moe_topk", "num_experts_per_token")


def experts_per_token(config: Any, default: int) -> int:
    """How many experts a token is routed to, by whichever name the family's config gives it."""
    for key in EXPERTS_PER_TOKEN_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return default


# the checkpoints' model types checked against transformers + bitsandbytes NF4, gated on the checkpoint's own type
# (a multimodal one's, not its text model's): those the support matrix (tests/support_matrix.py) finds exact, which
# hold tests/test_families.py's; tests/test_support_matrix.py holds this set to the matrix's record
CHECKED_FAMILIES = frozenset({
    "afmoe", "apertus", "arcee", "aria_text", "bitnet", "cohere", "cohere2", "cohere2_moe", "ctrl", "cwm",
    "deepseek_v3", "diffllama", "doge", "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe", "falcon",
    "flex_olmo", "flint", "fuyu", "gemma", "gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text",
    "gemma4_unified_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "got_ocr2", "gpt-sw3", "gpt2",
    "gpt_bigcode", "gpt_neox", "gpt_oss", "granite", "granite_swa", "granitemoe", "granitemoe_swa",
    "granitemoeshared", "hy_v3", "hyperclovax", "inkling_text", "internlm3", "iquestcoder", "jais2", "kolibri1",
    "laguna", "lfm2", "llama", "llama4", "llama4_text", "mellum", "minimax", "minimax_m2", "minimax_m3_vl_text",
    "ministral3", "mistral", "mixtral", "mllama", "moshi", "nanochat", "nemotron", "olmo", "olmo2", "olmo3",
    "olmoe", "opt", "persimmon", "phi", "phi3", "phi4_multimodal", "phimoe", "qwen2", "qwen2_moe", "qwen3",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "seed_oss", "smollm3", "solar_open",
    "stablelm", "starcoder2", "vaultgemma", "zaya",
}) | {"llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"}  # images: tests/test_vision.py (mllama: the matrix)


def refuse_unchecked_family(config: PretrainedConfig, allowed: bool) -> None:
    """A family no test holds to transformers could train to a silently different loss: refused unless asked for."""
    if allowed or config.model_type in CHECKED_FAMILIES:
        return
    raise ModelLoadError(f"{config.model_type}: this model family is not checked against transformers + bitsandbytes "
                         "(docs/model-families.md, the support matrix); set model.unchecked_family=true to train it "
                         "anyway")
