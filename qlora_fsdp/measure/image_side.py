"""The image side a plan counts, for a recipe whose records show images (`data.images_per_row`): what every rank holds
beside the sharded decoder while its micro-batch's images pass the vision tower (loading/vision_encoder.py builds
it, replicated and frozen), and the masks of a family whose image tokens see each other both ways.

The decoder's step is measured as for text (image tokens are tokens of the rows); the image side runs before the
decoder's forward and frees what it made (no gradients), so its forward adds to the resident bytes at its own
instant, not at the decoder's peak.
- weights: exact, from the checkpoint's full model on the meta device: the linears transformers + bitsandbytes make
  4-bit as packed NF4 and their quantization state (unless quant.vision_tower is `unquantized`), the rest in the
  compute dtype;
- the forward (an estimate): one layer's activations for the micro-batch's images (each image's patches through
  attention and the MLP, the attention scores of one head group at a time), beside the features it keeps;
- Gemma 3's masks (exact): two boolean [row, tokens, tokens] masks (full and sliding) per micro-batch;
- Llama 3.2 Vision: an image is one token of the row; its tiles' states, which the cross-attention layers read, are
  kept beside the decoder (counted with the features).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import AutoConfig, PretrainedConfig

from qlora_fsdp.config import Config
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.families import IMAGE_FAMILIES, check_images_supported
from qlora_fsdp.loading.checkpoint import model_dir
from qlora_fsdp.loading.image_side_training import under
from qlora_fsdp.loading.layout import meta_full_model
from qlora_fsdp.loading.vision_encoder import quantized_names
from qlora_fsdp.measure.fake_step import planned_objective, update_rows
from qlora_fsdp.measure.held import quant_state_bytes
from qlora_fsdp.measure.planning import Planning
from qlora_fsdp.optimizer_registry import OPTIMIZERS

ACTIVATIONS_PER_PATCH = 6  # hidden-sized tensors a vision layer keeps alive at once (norm, q, k, v, out, residual)


@dataclass(frozen=True)
class ImageSide:
    weights: int  # bytes every rank holds
    forward: int  # bytes the tower's forward adds at its peak (an estimate)
    masks: int  # bytes of a both-ways family's masks for a micro-batch
    images: int  # images a micro-batch passes
    tokens_per_image: int
    forward_flops: float = 0.0  # the tower and projector's forward over a micro-batch's images (an estimate)
    trained: int = 0  # gradients and optimizer state of what trains on it (lora.train_projector, target_vision_tower)


def full_config(planning: Planning) -> PretrainedConfig:
    """The checkpoint's whole config (the run's hf_config is its text model's)."""
    built = planning.run.built
    return AutoConfig.from_pretrained(model_dir(built), trust_remote_code=built.model.trust_remote_code)


def image_side_modules(full: nn.Module) -> list[tuple[str, nn.Module]]:
    """The full model's modules but the decoder's and the head's."""
    return [(name, module) for name, module in full.named_modules()
            if not ("language_model" in name or name.startswith("lm_head") or module is full)]


def weight_bytes(config: PretrainedConfig, cfg: Config, full: nn.Module | None = None) -> int:
    """The image side's bytes: NF4 where transformers quantizes, the compute dtype elsewhere (the decoder and the
    head are not the image side); what trains (lora.train_projector, lora.target_vision_tower's LoRA) in lora.dtype."""
    full = meta_full_model(config) if full is None else full
    quantized = quantized_names(full) if cfg.quant.vision_tower == "auto" else set()
    itemsize, trained_size = TORCH_DTYPES[cfg.quant.compute_dtype].itemsize, TORCH_DTYPES[cfg.lora.dtype].itemsize
    trained = projector_names(full, config) if cfg.lora.train_projector else []
    total = 0
    for name, module in image_side_modules(full):
        own = list(module.named_parameters(recurse=False))
        if under(name, trained):
            total += sum(p.numel() for _, p in own) * trained_size
            continue
        if name in quantized and isinstance(module, nn.Linear):
            n = module.in_features * module.out_features
            total += n // 2 + quant_state_bytes(n, cfg.quant.blocksize, cfg.quant.double_quant)
            own = [(key, p) for key, p in own if key != "weight"]
        total += sum(p.numel() * itemsize for _, p in own)
    return total + tower_lora_elements(full, config, cfg) * trained_size


def projector_names(full: nn.Module, config: PretrainedConfig) -> list[str]:
    return [f"{full.base_model_prefix}.{name}" for name in IMAGE_FAMILIES[config.model_type].projector]


def tower_lora_elements(full: nn.Module, config: PretrainedConfig, cfg: Config) -> int:
    """LoRA's A and B on the vision tower's linears (lora.target_vision_tower)."""
    if not cfg.lora.target_vision_tower:
        return 0
    projector = projector_names(full, config)
    return sum(cfg.lora.r * (module.in_features + module.out_features) for name, module in image_side_modules(full)
               if type(module) is nn.Linear and not under(name, projector))


def trained_bytes(full: nn.Module, config: PretrainedConfig, cfg: Config) -> int:
    """The gradients and optimizer state of what trains on the image side (whole on every rank)."""
    projector = projector_names(full, config) if cfg.lora.train_projector else []
    elements = tower_lora_elements(full, config, cfg) + sum(
        p.numel() for name, module in image_side_modules(full) if under(name, projector)
        for p in module.parameters(recurse=False))
    itemsize = TORCH_DTYPES[cfg.lora.dtype].itemsize
    return elements * itemsize + OPTIMIZERS[cfg.optim.name].state_bytes(elements, itemsize) if elements else 0


def patches_per_image(config: PretrainedConfig, cfg: Config) -> int:
    """The patches the vision tower reads for one image: its fixed size's, or a dynamic-resolution family's at the
    recipe's pixel budget (the most an image can be)."""
    vision = config.vision_config
    family = IMAGE_FAMILIES[config.model_type]
    if family.cross_attention:  # Llama 3.2 Vision: each of its tiles, and a class token each
        return int(vision.max_num_tiles * ((vision.image_size // vision.patch_size) ** 2 + 1))
    if not family.dynamic_resolution:
        return int((vision.image_size // vision.patch_size) ** 2)
    if cfg.data.image_max_pixels is None:
        raise ConfigError(f"data.images_per_row: a {IMAGE_FAMILIES[config.model_type].name} image is as many "
                          "tokens as its pixels make; set data.image_max_pixels (say 1003520: 1280 tokens) so the "
                          "plan can count them")
    return int(cfg.data.image_max_pixels // vision.patch_size**2)


def tokens_per_image(config: PretrainedConfig, cfg: Config) -> int:
    """The image tokens the decoder reads for one image (Gemma 3: mm_tokens_per_image; Qwen-VL: its patches merged
    2x2; LLaVA: its patches; Llama 3.2 Vision: its one token)."""
    fixed = getattr(config, "mm_tokens_per_image", None)
    if fixed:
        return int(fixed)
    if IMAGE_FAMILIES[config.model_type].cross_attention:  # one <|image|> token; the text reads its states
        return 1
    merged = getattr(config.vision_config, "spatial_merge_size", 1) ** 2
    return patches_per_image(config, cfg) // merged


# the recipe keys the image side reads (beside the checkpoint's config, one a planning, and the rows); what trains
# on it reads more
IMAGE_SIDE_READS = ("data.images_per_row", "data.context_length", "data.image_max_pixels", "quant.compute_dtype",
                    "quant.blocksize", "quant.double_quant", "quant.vision_tower", "lora.train_projector",
                    "lora.target_vision_tower")
TRAINED_SIDE_READS, TOWER_LORA_READS = ("lora.dtype", "optim.name"), ("lora.r",)


def image_setting(cfg: Config) -> str:
    """The key of the image side a plan keeps (tests/test_vision.py holds it to what side_of reads)."""
    lora = cfg.lora
    reads = (IMAGE_SIDE_READS + (TRAINED_SIDE_READS if lora.train_projector or lora.target_vision_tower else ())
             + (TOWER_LORA_READS if lora.target_vision_tower else ()))
    values = [getattr(getattr(cfg, section), key) for section, key in (d.split(".") for d in reads)]
    return repr((values, update_rows(cfg), rows_with_images(cfg)))


def image_side(planning: Planning, cfg: Config) -> ImageSide | None:
    """The recipe's image side (None: text only), worked out once per setting: a plan asks for it in every table."""
    if not cfg.data.images_per_row:
        return None
    key = image_setting(cfg)
    if key not in planning.sides:
        planning.sides[key] = side_of(planning, cfg)
    return planning.sides[key]


def side_of(planning: Planning, cfg: Config) -> ImageSide:
    per_row = cfg.data.images_per_row
    config = full_config(planning)
    check_images_supported(config)
    vision = config.vision_config
    itemsize = TORCH_DTYPES[cfg.quant.compute_dtype].itemsize
    rows = rows_with_images(cfg)
    images = rows * per_row
    patches = patches_per_image(config, cfg)
    layer = patches * (ACTIVATIONS_PER_PATCH * vision.hidden_size + 2 * vision.intermediate_size) * itemsize
    scores = patches * patches * 4  # one head's fp32 scores at a time (sdpa's math path on the widest GPUs)
    per_token = tokens_per_image(config, cfg)
    kept = patches if IMAGE_FAMILIES[config.model_type].cross_attention else per_token  # what the text reads
    features = images * kept * config.get_text_config().hidden_size * itemsize
    forward = images * (layer + scores) + features
    both_ways = IMAGE_FAMILIES[config.model_type].both_ways_masks is not None
    length = cfg.data.context_length
    masks = 2 * update_rows(cfg) * length * length if both_ways else 0
    full = meta_full_model(config)
    return ImageSide(weight_bytes(config, cfg, full), forward, masks, images, per_token,
                     images * image_flops(full, config, patches), trained_bytes(full, config, cfg))


def rows_with_images(cfg: Config) -> int:
    """Rows whose images pass the tower at once: a micro-batch's forward (GRPO's: every completion carries its
    prompt's images), or the largest generate call (each row's prompt re-read with its images)."""
    rows = update_rows(cfg)
    made = planned_objective(cfg).planned_generation()
    if made is not None:
        rows = max(rows, made.rows)
    return rows


def image_flops(full: nn.Module, config: PretrainedConfig, patches: int) -> float:
    """One image through the tower and projector (an estimate, high: every patch through every linear, and full
    attention in every layer, where Qwen2.5-VL's windows and the mergers' fewer tokens do less)."""
    vision = config.vision_config
    linear = sum(module.in_features * module.out_features for _, module in image_side_modules(full)
                 if isinstance(module, nn.Linear))
    layers = int(getattr(vision, "num_hidden_layers", None) or getattr(vision, "depth", None) or 0)
    return float(2 * linear * patches + 4 * layers * int(vision.hidden_size) * patches**2)
