"""What differs between model families, asked in one place by building, loading, attention and the adapter.

- **Checkpoint layout.** A checkpoint's keys are read through transformers' own conversion rules for its
  architecture (renamed and legacy keys), not a list of ours. A multimodal checkpoint (Gemma 3 4B-27B,
  Mistral 3) is trained as its text model alone: its decoder's keys are mapped onto the causal LM built from
  `text_config`, and the vision tower and projector are never read. The adapter is saved with the full model's
  names, so PEFT loads it onto the multimodal model.
- **Attention.** What a family's attention adds to causal attention (sliding windows, soft-capping, sinks) and
  whether transformers' sdpa can run it.
- **Recurrent token mixers** (Qwen3.5's Gated DeltaNet layers): their short convolution and recurrent state would
  run across the samples of a packed row, so they see one sample at a time.
- **Families not supported yet** (a 3-D weight no 4-bit layer replaced) are refused at build, in one line that
  names them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from qlora_fsdp.errors import ModelLoadError
from qlora_fsdp.model.attention import REGISTERED_NAME, VARLEN_SDPA, AttentionNeeds, sample_bounds

# families whose attention adds a learned logit per head to every softmax (transformers' `s_aux`)
SINK_FAMILIES = {"gpt_oss"}


# ---- multimodal checkpoints: the text model ------------------------------------------------------------------

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


def full_model_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The checkpoint's own architecture (config.json's `architectures`), as transformers would load it."""
    import transformers

    names = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, names[0], None) if names else None
    if model_class is None:
        raise ModelLoadError(f"{config.model_type}: config.json names no architecture transformers has ({names})")
    return model_class


# ---- checkpoint keys ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertPart:
    """A stored tensor that is one expert's share of a fused experts parameter: its `part` of `n_parts` stacked
    along the expert matrix's first dimension (Mixtral's w1 and w3 make gate_up_proj)."""

    expert: int
    part: int = 0
    n_parts: int = 1


class PartsWaiting:
    """Stored tensors that make one whole only together (an expert's gate and up projections, MXFP4's blocks and
    scales), held until the last part of their whole has come."""

    def __init__(self) -> None:
        self.waiting: dict[Any, dict[int, Any]] = {}

    def add(self, whole: Any, part: int, value: Any, n_parts: int) -> list[Any] | None:
        """All the parts of `whole` in order once this one completes it, else None."""
        parts = self.waiting.setdefault(whole, {})
        parts[part] = value
        if len(parts) < n_parts:
            return None
        del self.waiting[whole]
        return [parts[index] for index in range(n_parts)]

    def incomplete(self) -> Any | None:
        """A whole still missing some of its parts (after the last stored tensor: a damaged checkpoint)."""
        return next(iter(self.waiting), None)


def expert_part(stored_key: str, pattern: str, converter: Any, model_type: str) -> ExpertPart:
    """Which expert (the pattern's `*`) and part (the pattern's place among the converter's sources) a key holds.
    Only the merges transformers uses for experts are understood: stack the experts, then join the parts."""
    operations = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    if operations not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
        raise ModelLoadError(f"{model_type}: the checkpoint stores '{stored_key}' in a layout transformers converts "
                             f"with {operations} at load, which loading here does not know")
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), stored_key)
    assert found is not None, "transformers matched this key with this pattern"
    return ExpertPart(int(found.group(1)), converter.source_patterns.index(pattern), len(converter.source_patterns))


@dataclass
class CheckpointLayout:
    """Maps checkpoint keys to the keys of the causal LM we build, and our names back to the checkpoint's model."""

    renamings: list[Any] = field(default_factory=list)  # transformers' WeightRenaming rules for this architecture
    converters: list[Any] = field(default_factory=list)  # rules that merge tensors (per-expert -> fused)
    prefix: str = ""  # base_model_prefix of the checkpoint's model
    full_keys: dict[str, bool] = field(default_factory=dict)  # parameter names of the checkpoint's model (meta)
    text_prefix: str | None = None  # multimodal: where the decoder sits in the full model ("model.language_model.")
    decoder_prefix: str = "model."  # where it sits in the causal LM we build
    head_name: str = "lm_head."
    model_type: str = ""

    def full_key(self, stored_key: str) -> tuple[str, ExpertPart | None]:
        """The stored key renamed as transformers' loading renames it for the checkpoint's architecture, and for a
        tensor that transformers merges into a fused experts parameter, which expert and which part of it."""
        from transformers.core_model_loading import rename_source_key

        renamed, pattern = rename_source_key(stored_key, self.renamings, self.converters, self.prefix or None,
                                             self.full_keys or None)
        converter = next((c for c in self.converters if pattern in c.source_patterns), None) if pattern else None
        if converter is None or pattern is None:
            return renamed, None
        return renamed, expert_part(stored_key, pattern, converter, self.model_type)

    def model_key(self, stored_key: str) -> tuple[str | None, ExpertPart | None]:
        """Our model's key for a stored tensor (None for a part the text model does not hold, a vision tower), and
        the expert it holds where the checkpoint keeps experts one by one."""
        key, part = self.full_key(stored_key)
        return self.ours_from_full(key), part

    def ours_from_full(self, key: str) -> str | None:
        if self.text_prefix is None or key.startswith(self.head_name):
            return key
        if key.startswith(self.text_prefix):
            return self.decoder_prefix + key.removeprefix(self.text_prefix)
        return None

    def full_from_ours(self, key: str) -> str:
        """Our model's name as the checkpoint's full model spells it (the adapter's names on disk)."""
        if self.text_prefix is None or not key.startswith(self.decoder_prefix):
            return key
        return self.text_prefix + key.removeprefix(self.decoder_prefix)


def checkpoint_layout(path: Path | None, built: PreTrainedModel, trust_remote_code: bool = False) -> CheckpointLayout:
    """The layout of the checkpoint folder `path` (None: a model with random weights, our own names)."""
    if path is None or not (path / "config.json").is_file():
        return CheckpointLayout(model_type=built.config.model_type)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    full = meta_full_model(config) if is_multimodal(config) else built
    layout = layout_from_transforms(full)
    if full is not built:
        decoder_type = type(getattr(built, built.base_model_prefix))
        found = [name for name, module in full.named_modules() if type(module) is decoder_type]
        if not found:
            raise ModelLoadError(f"{config.model_type}: its {type(full).__name__} holds no {decoder_type.__name__}; "
                                 "this multimodal family is not supported yet")
        layout.text_prefix, layout.decoder_prefix = found[0] + ".", built.base_model_prefix + "."
    return layout


def meta_full_model(config: PretrainedConfig) -> PreTrainedModel:
    with torch.device("meta"):
        return full_model_class(config)(config)


def layout_from_transforms(model: PreTrainedModel) -> CheckpointLayout:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(model)
    return CheckpointLayout(
        renamings=[t for t in transforms if isinstance(t, WeightRenaming)],
        converters=[t for t in transforms if isinstance(t, WeightConverter)],
        prefix=model.base_model_prefix,
        full_keys=dict.fromkeys((name for name, _ in model.named_parameters(remove_duplicate=False)), True),
        model_type=model.config.model_type,
    )


def lora_target_regex(layout: CheckpointLayout, lora_module_names: list[str]) -> str | None:
    """For a multimodal checkpoint: a `target_modules` regex that names only the decoder's LoRA modules, so PEFT
    attaches nothing to the vision tower (whose q_proj/fc1 a plain name list would also match). None otherwise."""
    if layout.text_prefix is None:
        return None
    leaves = sorted({name.rsplit(".", 1)[-1] for name in lora_module_names})
    return rf"{re.escape(layout.text_prefix)}.*\.({'|'.join(map(re.escape, leaves))})"


# ---- families not supported yet --------------------------------------------------------------------------------

def refuse_unsupported(model: nn.Module) -> None:
    """A 3-D experts parameter left after the 4-bit swaps is a layout no 4-bit layer replaced (a short convolution's
    3-D weight, Qwen3.5's, is not an expert)."""
    for name, param in model.named_parameters():
        if param.ndim == 3 and ".experts." in f".{name}.":
            model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise ModelLoadError(f"{model_type} holds '{name}', a 3-D weight of a layout 4-bit loading does not know "
                                 "yet, so it would train unquantized")


# ---- attention -------------------------------------------------------------------------------------------------

def attention_needs(config: PretrainedConfig) -> AttentionNeeds:
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return AttentionNeeds(
        family=config.model_type,
        softcap=getattr(config, "attn_logit_softcapping", None) is not None,
        sinks=config.model_type in SINK_FAMILIES,
        sdpa=bool(getattr(model_class, "_supports_sdpa", True)),
    )


def describe_attention(model: nn.Module) -> str:
    """The start-up line: the kernel the run uses and what of the family's attention it computes."""
    config = getattr(model, "config", None)
    assert isinstance(config, PretrainedConfig), "a transformers model (or PEFT's wrapper of one) has a config"
    kernel = VARLEN_SDPA if config._attn_implementation == REGISTERED_NAME else config._attn_implementation
    needs, window = attention_needs(config), getattr(config, "sliding_window", None)
    computed = [f"sliding windows of {window} tokens"] if window and getattr(config, "use_sliding_window", True) else []
    computed += ["logit soft-capping"] * needs.softcap + ["attention sinks"] * needs.sinks
    if any(recurrent_mixers(layer) for layer in decoder_layers_of(model)):
        computed.append("recurrent layers one sample at a time")
    return f"attention: {kernel} for {config.model_type}" + (f" ({', '.join(computed)})" if computed else "")


def decoder_layers_of(model: nn.Module) -> list[nn.Module]:
    from qlora_fsdp.model.build import decoder_layers  # build imports this module

    return decoder_layers(model)


# ---- recurrent token mixers: one sample at a time ---------------------------------------------------------------

def recurrent_mixers(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's token mixers that carry state along the tokens: those holding a short convolution."""
    return [child for child in layer.children() if any(isinstance(m, nn.Conv1d) for m in child.modules())]


def run_mixers_per_sample(layers: list[nn.Module]) -> None:
    """Packed rows reach a recurrent mixer one sample at a time (its state starts afresh at each sample's start).

    The decoder layer sees the position ids (with the batch's sample bounds); a pre-hook hands the bounds to its
    mixers, whose forward splits the row. Checkpointing's recompute runs the layer again, and the hook with it."""
    for layer in layers:
        mixers = recurrent_mixers(layer)
        if not mixers:
            continue
        for mixer in mixers:
            mixer.forward = functools.partial(per_sample_forward, mixer, mixer.forward)
        layer.register_forward_pre_hook(functools.partial(hand_bounds_to, mixers), with_kwargs=True)


def hand_bounds_to(mixers: list[nn.Module], _layer: nn.Module, args: tuple, kwargs: dict) -> None:
    positions = kwargs.get("position_ids")
    bounds = None
    if isinstance(positions, torch.Tensor) and positions.ndim == 2:
        bounds = getattr(positions, "sample_bounds", None) or [sample_bounds(row) for row in positions]
    for mixer in mixers:
        vars(mixer)["packed_bounds"] = bounds  # a plain attribute, read by per_sample_forward


def per_sample_forward(mixer: nn.Module, forward: Callable[..., torch.Tensor], hidden_states: torch.Tensor,
                       *args: Any, **kwargs: Any) -> torch.Tensor:
    bounds = getattr(mixer, "packed_bounds", None)
    if bounds is None or all(len(row) == 1 for row in bounds) or kwargs.get("cache_params") is not None:
        return forward(hidden_states, *args, **kwargs)
    rows = []
    for row, row_bounds in enumerate(bounds):
        parts = [forward(hidden_states[row : row + 1, start:end], *args, **kwargs) for start, end in row_bounds]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows)
