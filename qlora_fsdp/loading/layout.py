"""How a checkpoint's keys map onto the causal LM we build, read through transformers' own conversion rules for its
architecture (renamed and legacy keys, per-expert tensors that transformers fuses), not a list of ours. A multimodal
checkpoint (Gemma 3 4B-27B, Mistral 3) is trained as its text model alone: its decoder's keys are mapped onto the
causal LM built from `text_config`, and the vision tower and projector are never read. The adapter is saved with
the full model's names, so PEFT loads it onto the multimodal model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from qlora_fsdp.errors import ModelLoadError
from qlora_fsdp.families import full_model_class, is_multimodal
from qlora_fsdp.loading.image_side_training import IMAGE_SIDE


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
    full_head_name: str = "lm_head."  # the head in the checkpoint's model (Llama 4's: "language_model.lm_head.")
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
        if self.text_prefix is None:
            return key
        if key.startswith(self.full_head_name):
            return self.head_name + key.removeprefix(self.full_head_name)
        if key.startswith(self.text_prefix):
            return self.decoder_prefix + key.removeprefix(self.text_prefix)
        return None

    def full_from_ours(self, key: str) -> str:
        """Our model's name as the checkpoint's full model spells it (the adapter's names on disk); a trained image
        side's (loading/image_side_training.py) is the full model's base model's."""
        if key.startswith(IMAGE_SIDE + "."):
            return f"{self.prefix}.{key.removeprefix(IMAGE_SIDE + '.')}"
        if self.text_prefix is not None and key.startswith(self.head_name):
            return self.full_head_name + key.removeprefix(self.head_name)
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
        decoder = decoder_name(built)
        decoder_type = type(getattr(built, decoder))
        found = [name for name, module in full.named_modules() if type(module) is decoder_type]
        if not found:
            raise ModelLoadError(f"{config.model_type}: its {type(full).__name__} holds no {decoder_type.__name__}; "
                                 "this multimodal family is not supported yet")
        layout.text_prefix, layout.decoder_prefix = found[0] + ".", decoder + "."
        layout.full_head_name = head_name(full) + "."
    return layout


def decoder_name(built: PreTrainedModel) -> str:
    """The attribute of our causal LM that holds its decoder: its base_model_prefix, or where that names no attribute
    (Llama 4's text model keeps `model` under the prefix `language_model`, the name it has in the multimodal model)
    its one child that is a pretrained model."""
    if hasattr(built, built.base_model_prefix):
        return built.base_model_prefix
    found = [name for name, child in built.named_children() if isinstance(child, PreTrainedModel)]
    if len(found) != 1:
        raise ModelLoadError(f"{built.config.model_type}: {type(built).__name__} holds its decoder neither under "
                             f"'{built.base_model_prefix}' nor as its one pretrained child ({found}); this "
                             "multimodal family is not supported yet")
    return found[0]


def head_name(full: PreTrainedModel) -> str:
    """Where the multimodal model keeps the output layer: `lm_head` (Gemma 3), `language_model.lm_head` (Llama 4)."""
    head = full.get_output_embeddings()
    return next((name for name, module in full.named_modules() if module is head), "lm_head")


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
        full_keys=dict.fromkeys([*(name for name, _ in model.named_parameters(remove_duplicate=False)),
                                 *(name for name, _ in persistent_buffers(model))], True),
        model_type=model.config.model_type,
    )


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint holds (Gemma 4's `layer_scalar`, DeepSeek-V3's router `e_score_correction_bias`)."""
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield f"{module_name}.{name}" if module_name else name, buffer


def lora_target_regex(layout: CheckpointLayout, lora_module_names: list[str]) -> str | None:
    """For a multimodal checkpoint: a `target_modules` regex that names only the decoder's LoRA modules, so PEFT
    attaches nothing to the vision tower (whose q_proj/fc1 a plain name list would also match). None otherwise."""
    if layout.text_prefix is None:
        return None
    leaves = sorted({name.rsplit(".", 1)[-1] for name in lora_module_names})
    return rf"{re.escape(layout.text_prefix)}.*\.({'|'.join(map(re.escape, leaves))})"





