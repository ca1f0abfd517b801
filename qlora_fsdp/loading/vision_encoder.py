"""A vision-language checkpoint's image side, loaded: the vision tower and projector beside the causal LM that
trains (built from `text_config`, sharded, 4-bit with LoRA); vision/image_embeddings.py puts its features in.

It is the checkpoint's own base model (`LlavaModel`, ...), built without its decoder (a one-layer one, dropped) and
read from the checkpoint: `get_image_features` is the family's own code. Its linears are NF4 where transformers +
bitsandbytes quantize them (every nn.Linear but the modules transformers keeps), with the recipe's quantization
settings, so the image features are the reference's. Frozen; every rank loads it whole.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig, ProcessorMixin

from qlora_fsdp.config import Config
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.errors import ConfigError, ModelLoadError, first_line
from qlora_fsdp.families import IMAGE_FAMILIES, check_images_supported, full_model_class, is_multimodal
from qlora_fsdp.loading.build import make_meta_linear4bit
from qlora_fsdp.loading.checkpoint import model_dir
from qlora_fsdp.loading.fill import set_quant_state
from qlora_fsdp.loading.image_side_training import (
    attach_trained,
    make_trainable,
    projector_modules,
    trains_image_side,
    under,
)
from qlora_fsdp.loading.layout import CheckpointLayout, layout_from_transforms, meta_full_model
from qlora_fsdp.loading.nf4 import quantize
from qlora_fsdp.loading.weight_files import stored_weight_tensors
from qlora_fsdp.vision.image_embeddings import VisionEncoder, attach_vision_encoder


def load_processor(cfg: Config) -> ProcessorMixin:
    """The checkpoint's own processor (its chat template, image processor and image-token expansion); a text-only
    checkpoint is refused in one line."""
    from transformers import AutoProcessor

    config = checkpoint_config(cfg)
    if not is_multimodal(config):
        raise ModelLoadError(f"the data's records show images, but {cfg.model.path} is a {config.model_type} "
                             "checkpoint without a vision tower; use a vision-language checkpoint, or text-only "
                             "records")
    check_images_supported(config)

    try:
        processor = AutoProcessor.from_pretrained(model_dir(cfg), trust_remote_code=cfg.model.trust_remote_code)
    except ImportError as err:
        if "VideoProcessor" not in str(err):
            raise
        processor = processor_without_videos(cfg)  # transformers' video processors need torchvision; images do not
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{cfg.model.path}: records with images need the checkpoint's processor, which "
                             f"cannot be loaded ({first_line(err)})") from None
    return with_pixel_budget(processor, cfg, config)


def with_pixel_budget(processor: ProcessorMixin, cfg: Config, config: PretrainedConfig) -> ProcessorMixin:
    """The recipe's data.image_min_pixels / image_max_pixels in the image processor's size (a dynamic-resolution
    family's); a family that resizes every image to one size refuses them in one line."""
    low, high = cfg.data.image_min_pixels, cfg.data.image_max_pixels
    if low is None and high is None:
        return processor
    family = IMAGE_FAMILIES[config.model_type]
    if not family.dynamic_resolution:
        raise ConfigError(f"data.image_min_pixels / image_max_pixels: {family.name} resizes every image to one "
                          "size; the pixel budget is for dynamic-resolution families (Qwen2.5-VL): remove the keys")
    images: Any = cast(Any, processor).image_processor
    size = dict(images.size)
    size.update({key: value for key, value in (("shortest_edge", low), ("longest_edge", high)) if value is not None})
    images.size = type(images.size)(**size)
    return processor


def processor_without_videos(cfg: Config) -> ProcessorMixin:
    """The checkpoint's processor with its image processor and tokenizer and no video processor (Qwen-VL's needs
    torchvision, which a machine may lack; records here hold images only)."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

    path, remote = model_dir(cfg), cfg.model.trust_remote_code
    images = AutoImageProcessor.from_pretrained(path, trust_remote_code=remote)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=remote)
    family_class = processor_class_from_name(PROCESSOR_MAPPING_NAMES.get(checkpoint_config(cfg).model_type, ""))
    if family_class is None:
        raise ModelLoadError(f"{path}: its processor needs torchvision (for videos); install torchvision")

    class ImagesOnly(family_class):  # type: ignore[valid-type, misc]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnly(image_processor=images, tokenizer=tokenizer, video_processor=None,
                      chat_template=processor_chat_template(path) or tokenizer.chat_template)


def processor_chat_template(folder: Path) -> str | None:
    """The processor's own chat template, where the checkpoint ships one (chat_template.jinja, or .json's)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return str(json.loads((folder / "chat_template.json").read_text())["chat_template"])
    return None


def checkpoint_config(cfg: Config) -> PretrainedConfig:
    return AutoConfig.from_pretrained(model_dir(cfg), trust_remote_code=cfg.model.trust_remote_code)


def image_token_id(config: PretrainedConfig) -> int:
    found = getattr(config, "image_token_id", None)
    if found is None:
        found = getattr(config, "image_token_index", None)
    if found is None:
        raise ModelLoadError(f"{config.model_type}: its config names no image token (image_token_id)")
    return int(found)


def without_decoder(config: PretrainedConfig) -> PretrainedConfig:
    """The checkpoint's config with a one-layer decoder: the base model is built for its image side only."""
    small = copy.deepcopy(config)
    text = small.get_text_config()
    text.num_hidden_layers = 1
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:1]
    return small


def quantized_names(full: Any) -> set[str]:
    """The full model's linears (built on the meta device) transformers + bitsandbytes make 4-bit (its own rule:
    every one but those it keeps, the head and `_keep_in_fp32_modules`)."""
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    keep = HfQuantizer.get_modules_to_not_convert(full, None, list(full._keep_in_fp32_modules or []))
    return {name for name, module in full.named_modules()  # exactly nn.Linear, as transformers: not MHA's out_proj
            if type(module) is nn.Linear and should_convert_module(name, keep)}


def build_base(config: PretrainedConfig, dtype: torch.dtype) -> tuple[nn.Module, str]:
    """The base model of the checkpoint's class on the CPU, its decoder dropped; and its name in the full model."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        full: Any = full_model_class(config)(without_decoder(config))
    full.to(dtype)
    prefix = full.base_model_prefix
    base = getattr(full, prefix)
    decoder = getattr(base, "language_model", None)
    if decoder is None:
        raise ModelLoadError(f"{config.model_type}: its base model has no language_model; images are not supported "
                             "for this family yet")
    base.language_model = None
    return base, prefix + "."


def read_image_side(base: nn.Module, prefix: str, folder: Path, layout: CheckpointLayout, text_prefix: str) -> None:
    """The stored tensors of everything but the decoder and the head, into `base` (every one must come)."""
    params = dict(base.named_parameters())
    buffers = {name: b for name, b in base.named_buffers() if name in base.state_dict()}
    wanted = {**params, **buffers}
    found: set[str] = set()
    for stored_key, stored, _ in stored_weight_tensors(folder, allow_pickle=False):
        key, part = layout.full_key(stored_key)
        if key.startswith(text_prefix) or not key.startswith(prefix) or part is not None:
            continue
        name = key.removeprefix(prefix)
        if name not in wanted:
            continue
        value = stored.read()
        if tuple(value.shape) != tuple(wanted[name].shape):
            raise ModelLoadError(f"checkpoint tensor {stored_key} of shape {tuple(value.shape)} where the config "
                                 f"wants {tuple(wanted[name].shape)}")
        with torch.no_grad():
            wanted[name].copy_(value.to(wanted[name].dtype))
        found.add(name)
    missing = sorted(set(params) - found)
    if missing:
        raise ModelLoadError(f"{folder}: the checkpoint lacks the vision tower's {missing[0]} (and {len(missing) - 1} "
                             "more): not a vision-language checkpoint of its config's family")


def quantize_linears(base: nn.Module, prefix: str, names: set[str], cfg: Config, device: torch.device) -> int:
    """NF4 in place of the linears the reference quantizes (the recipe's blocksize and double quantization)."""
    count = 0
    for name, module in list(base.named_modules()):
        if type(module) is not nn.Linear or prefix + name not in names:
            continue
        layer = make_meta_linear4bit(module, cfg.quant)
        layer.to_empty(device=device)
        packed, state = quantize(module.weight.detach().to(device), cfg.quant, layer.weight.dtype)
        layer.weight.data = packed
        set_quant_state(layer, state)
        if module.bias is not None:
            layer.bias.data = module.bias.detach().to(device)
        parent_name, _, leaf = name.rpartition(".")
        setattr(base.get_submodule(parent_name) if parent_name else base, leaf, layer)
        count += 1
    return count


def build_vision_encoder(cfg: Config, device: torch.device) -> VisionEncoder:
    config = checkpoint_config(cfg)
    if not is_multimodal(config):
        raise ModelLoadError(f"{cfg.model.path}: a {config.model_type} checkpoint has no vision tower; records with "
                             "images need a vision-language checkpoint")
    check_images_supported(config)
    dtype = TORCH_DTYPES[cfg.quant.compute_dtype]
    base, prefix = build_base(config, dtype)
    layout = layout_from_transforms(meta_full_model(config))
    text_prefix = prefix + "language_model."
    read_image_side(base, prefix, model_dir(cfg), layout, text_prefix)
    family = IMAGE_FAMILIES[config.model_type]
    if cfg.quant.vision_tower == "auto":
        trained = [prefix + name for name in projector_modules(base, family)] if cfg.lora.train_projector else []
        names = {name for name in quantized_names(meta_full_model(config)) if not under(name, trained)}
        quantize_linears(base, prefix, names, cfg, device)
    base.to(device).eval().requires_grad_(False)
    if trains_image_side(cfg):
        make_trainable(base, cfg, family)
    return VisionEncoder(base, image_token_id(config), dtype, family.both_ways_masks, family.grid_positions,
                         family.cross_attention, int(getattr(config.vision_config, "max_num_tiles", 1)),
                         trains=trains_image_side(cfg))


def load_vision_encoder(model: nn.Module, cfg: Config, device: torch.device) -> VisionEncoder:
    """Build the checkpoint's image side and keep it beside `model` (the decoder that trains)."""
    encoder = build_vision_encoder(cfg, device)
    attach_vision_encoder(model, encoder)
    if encoder.trains:
        attach_trained(model, encoder.base)
    return encoder
