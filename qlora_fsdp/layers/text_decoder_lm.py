"""A causal LM over a vision-language family's own text model, for the families transformers gives none (Qwen2.5-VL,
Qwen3-VL; Llama 3.2 Vision's has one whose base_model_prefix names no attribute of it): the decoder of the
checkpoint's class (`model`) and the head (`lm_head`), registered with AutoModelForCausalLM so it is built, sharded
and loaded as every decoder here. Checkpoint keys map onto it as for Gemma 3 (loading/layout.py):
`model.language_model.` <-> `model.`.

Positions. Qwen-VL's decoders take [3, batch, tokens] rotary positions (temporal, height, width), plus, as a fourth
row in front, the plain text positions that say where packed samples start. A text row is the same on every axis, so
the plain [batch, tokens] positions training gives become the four rows here; the image tokens' own positions are
filled in by vision/image_embeddings.py from the images' grids.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

# the text configs of the vision-language families whose decoder has no causal-LM class in transformers (Llama 3.2
# Vision's has one whose base_model_prefix names no attribute of it): its text model's class, and whether its
# positions run over 3 axes
TEXT_MODELS = {"qwen2_5_vl_text": ("Qwen2_5_VLTextModel", True), "qwen3_vl_text": ("Qwen3VLTextModel", True),
               "mllama_text_model": ("MllamaTextModel", False)}


class TextDecoderLM(PreTrainedModel, GenerationMixin):
    """`model` (the family's text model) and `lm_head`; the subclass per family names its classes."""

    base_model_prefix = "model"
    text_model_class: type[PreTrainedModel]
    grid_positions: bool  # the decoder takes [text, temporal, height, width] positions (Qwen-VL)
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.model = self.text_model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.set_input_embeddings(value)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Any = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> CausalLMOutputWithPast:
        bounds = getattr(position_ids, "sample_bounds", None)  # packed rows' samples (losses/forward.py)
        if bounds is not None:
            kwargs["sample_bounds"] = bounds  # the four rows are a new tensor: the attention reads them here
        positions = four_rows(position_ids) if self.grid_positions else position_ids
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, kept]), past_key_values=out.past_key_values)


def four_rows(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """Plain positions [batch, tokens] as the decoder's [text, temporal, height, width] rows (text tokens: all the
    same); positions already given per axis as they are."""
    if position_ids is None or position_ids.ndim == 3:
        return position_ids
    return position_ids.unsqueeze(0).expand(4, -1, -1)


def causal_lm_class(text_model_class: type[PreTrainedModel], grid_positions: bool) -> type[TextDecoderLM]:
    """TextDecoderLM for one family: its pretrained base's weight init and kernels, its text config."""
    family_base = next(base for base in text_model_class.__mro__[1:]
                       if issubclass(base, PreTrainedModel) and base is not PreTrainedModel)
    name = text_model_class.__name__.removesuffix("TextModel").removesuffix("Model") + "TextForCausalLM"
    layer_names = [name for name in getattr(family_base, "_no_split_modules", None) or [] if "Decoder" in name]
    return type(name, (TextDecoderLM, family_base), {
        "config_class": text_model_class.config_class, "text_model_class": text_model_class,
        "grid_positions": grid_positions,
        "base_model_prefix": "model", "_no_split_modules": layer_names, "__module__": __name__})


def register_text_decoders() -> None:
    """Register a causal LM for each family in TEXT_MODELS (once; idempotent)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type, (class_name, grid_positions) in TEXT_MODELS.items():
        config_class = CONFIG_MAPPING[model_type]
        if config_class in AutoModelForCausalLM._model_mapping:
            continue
        # exist_ok: transformers skips registering a class for one of its own configs without it
        text_model_class = cast(type[PreTrainedModel], getattr(transformers, class_name))
        AutoModelForCausalLM.register(config_class, causal_lm_class(text_model_class, grid_positions), exist_ok=True)

