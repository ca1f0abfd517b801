"""Build the model on the meta device, swap linears for NF4 `Linear4bit`, attach LoRA/DoRA.

No weight is read here and nothing here knows about ranks: `fill.py` fills the (possibly sharded)
parameters afterwards, one tensor at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import bitsandbytes as bnb
import peft
import torch
from accelerate import init_empty_weights
from peft.tuners.lora.dora import DoraLinearLayer
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from qlora_fsdp.config import Config, LoraConfig, QuantConfig
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.errors import ConfigError, ModelLoadError
from qlora_fsdp.families import refuse_mxfp4_dense
from qlora_fsdp.layers import expert_lora
from qlora_fsdp.layers.attention import transformers_name
from qlora_fsdp.layers.decoder import decoder_layers, give_attention_the_positions, run_mixers_per_sample
from qlora_fsdp.layers.experts4bit import Experts4bit, quantize_experts, router_class
from qlora_fsdp.layers.fused_lora import fuse_lora_projections, shared_input_groups
from qlora_fsdp.layers.reward_head import attach_reward_head
from qlora_fsdp.layers.trained_embeddings import train_embeddings
from qlora_fsdp.loading.checkpoint import checkpoint_folder
from qlora_fsdp.loading.layout import CheckpointLayout, checkpoint_layout
from qlora_fsdp.loading.names import is_lora_tensor
from qlora_fsdp.loading.reader import stored_4bit_weights

# 4-bit values are packed two to a byte and stored as raw bytes. FSDP2 never casts a non-float parameter and
# all-gathers it as bytes, whatever the mixed-precision policy or the LoRA dtype. The earlier bf16 storage was
# not safe: on CUDA (sm80+) FSDP2's all-gather copy-in reads bf16 through float and rewrites every bf16 NaN bit
# pattern as 0x7FFF, so about 0.1% of the packed bytes decode to other 4-bit values whenever a layer's
# all-gather is uniformly bf16 (bitsandbytes #1945, pytorch #159333; emulated on CPU in tests/test_numerics.py).
QUANT_STORAGE = torch.uint8


def build_meta_model(cfg: Config, hf_config: PretrainedConfig, attention: str = "eager") -> peft.PeftModel:
    """The full model with its parameters on the meta device: frozen NF4 base with LoRA adapters, ready for
    sharding, and the layout of its checkpoint attached. `attention`: the kernel (attention.resolve_attention's
    answer for the run; eager, which every family has, where only the names matter)."""
    # buffers stay real: computed by the model's own code (rotary frequencies, Gemma's embedding scale), which
    # is the only code that knows how; materialize keeps their values through to_empty
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            hf_config, dtype=TORCH_DTYPES[cfg.model.dtype], trust_remote_code=cfg.model.trust_remote_code,
            attn_implementation=transformers_name(attention),
        )
    keep_buffers_in_fp32(model)
    model.tie_weights()  # transformers ties the head to the embeddings only when it made the parameters itself
    layout = checkpoint_layout(checkpoint_folder(cfg), model, cfg.model.trust_remote_code)
    run_mixers_per_sample(decoder_layers(model))
    give_attention_the_positions(decoder_layers(model))
    swap_linears_for_4bit(model, cfg.quant, stored_4bit_linears(checkpoint_folder(cfg), layout))
    quantize_experts(model, cfg.quant)
    refuse_mxfp4_dense(hf_config, has_experts=any(isinstance(m, Experts4bit) for m in model.modules()))
    refuse_unsupported(model)
    model.requires_grad_(False)
    model.config.use_cache = False  # no KV cache while training
    peft_model = attach_lora(model, cfg.lora, bool(cfg.activation_checkpointing.attention_tile_tokens))
    if cfg.lora.train_embeddings:  # trained in full, saved as PEFT's modules_to_save
        trained = train_embeddings(peft_model, TORCH_DTYPES[cfg.lora.dtype], TORCH_DTYPES[cfg.model.dtype])
        config = cast(peft.LoraConfig, peft_model.peft_config["default"])
        config.modules_to_save = [*(config.modules_to_save or []), *trained]
    if cfg.train.kind.reward_head:  # a reward model: the scalar head beside the language model's
        attach_reward_head(peft_model.get_base_model(), hf_config.get_text_config().hidden_size,
                           TORCH_DTYPES[cfg.lora.dtype])
    vars(peft_model)["checkpoint_layout"] = layout  # a plain attribute: read by loading, the adapter and merge
    return peft_model


def keep_buffers_in_fp32(model: nn.Module) -> None:
    """The buffers transformers keeps in float32 whatever the model's dtype (DeepSeek-V3's router score correction,
    which a bf16 default would round), as its loading keeps them."""
    names = [*(getattr(model, "_keep_in_fp32_modules_strict", None) or []),
             *(getattr(model, "_keep_in_fp32_modules", None) or [])]
    if not names:
        return
    pattern = re.compile("|".join(re.escape(name) for name in names))
    for module_name, module in model.named_modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_floating_point() and pattern.search(f"{module_name}.{name}"):
                module._buffers[name] = buffer.float()


def stored_4bit_linears(folder: Path | None, layout: CheckpointLayout) -> set[str] | None:
    """The linear layers a pre-quantized checkpoint stores in 4-bit (our module names); None for a checkpoint that
    stores none (its linears are quantized at load, all but quant.skip_modules)."""
    keys = stored_4bit_weights(folder)
    if not keys:
        return None
    ours = {layout.model_key(key)[0] for key in keys}
    return {key.removesuffix(".weight") for key in ours if key is not None}


def swap_linears_for_4bit(model: nn.Module, quant: QuantConfig, stored_4bit: set[str] | None = None) -> None:
    """Replace every nn.Linear but the skipped ones with a meta `Linear4bit` of the packed shape; for a pre-quantized
    checkpoint exactly those it stores in 4-bit (the others it keeps unquantized, and so does training)."""
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:  # as transformers' swap: a subclass (Llama 4's router) keeps its forward
            continue
        skipped = name.rsplit(".", 1)[-1] in quant.skip_modules if stored_4bit is None else name not in stored_4bit
        if skipped:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make_meta_linear4bit(module, quant))


def make_meta_linear4bit(linear: nn.Linear, quant: QuantConfig) -> bnb.nn.Linear4bit:
    n_elements = linear.in_features * linear.out_features
    if n_elements % quant.blocksize:
        raise ModelLoadError(f"a {linear.out_features}x{linear.in_features} linear is not a multiple of the "
                             f"quantization blocksize {quant.blocksize}; add it to quant.skip_modules")
    layer = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=TORCH_DTYPES[quant.compute_dtype],
        compress_statistics=quant.double_quant,
        quant_type=quant.quant_type,
        quant_storage=QUANT_STORAGE,
        device="meta",
    )
    packed_rows = n_elements // 2 // QUANT_STORAGE.itemsize  # two 4-bit values a byte
    layer.weight = bnb.nn.Params4bit(
        torch.empty(packed_rows, 1, dtype=QUANT_STORAGE, device="meta"),
        requires_grad=False,
        blocksize=quant.blocksize,
        compress_statistics=quant.double_quant,
        quant_type=quant.quant_type,
        quant_storage=QUANT_STORAGE,
        bnb_quantized=True,
        module=layer,
    )
    if linear.bias is not None:
        layer.bias = nn.Parameter(torch.empty_like(linear.bias, device="meta"), requires_grad=False)
    # bitsandbytes repacks 4-bit weights in place for AVX512-BF16 CPUs in no-grad eval forwards; under
    # FSDP that rewrites a gathered copy with the wrong shape and crashes, so keep the portable kernel.
    layer.support_avx512bf16_for_cpu = False
    return layer


def attach_lora(model: nn.Module, lora: LoraConfig, attention_tiled: bool = False) -> peft.PeftModel:
    targets = lora_targets(model, lora.target_modules)
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        exclude_modules=outside_the_layers(model) if lora.target_modules == "all-linear" else None,
        use_dora=lora.use_dora,
        use_rslora=lora.use_rslora,  # saved in adapter_config.json, so PEFT and the merge scale alike
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=False,  # weights are meta now; fill.py initializes them, the same on any world size
    )
    check_targets(model, targets)
    with meta_dora_magnitudes():
        model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    refuse_expert_lora(model, targets)
    add_expert_training(model, lora)
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(TORCH_DTYPES[lora.dtype])
    fuse_lora_projections(model, lora, shared_input_groups(attention_tiled))
    return model


def add_expert_training(model: peft.PeftModel, lora: LoraConfig) -> None:
    """lora.target_experts and lora.train_router, recorded in the adapter's config as PEFT would record them."""
    expert_lora.check_expert_training(model, lora)
    config = model.peft_config["default"]
    assert isinstance(config, peft.LoraConfig), "attach_lora makes the adapter from a peft.LoraConfig"
    if lora.target_experts:
        expert_lora.attach_expert_lora(model, lora)
        config.target_parameters = expert_lora.target_parameters(model)
    if lora.train_router:
        config.modules_to_save = expert_lora.train_routers(model, lora)


def lora_targets(model: nn.Module, targets: str | list[str]) -> str | list[str]:
    """all-linear on a mixture of experts means its linear layers (attention, dense MLPs, shared experts): PEFT would
    otherwise add the experts and the router, as the linear layers of the model's transformers 4 layout (a router that
    subclasses nn.Linear, Llama 4's, is left out too). Where PEFT
    reads a projection's name as an expert's of that layout (DeepSeek-V3's, GLM-4.5's and Qwen3-Next's `gate_proj`,
    `up_proj`, `down_proj`), the dense MLPs and shared experts keep no LoRA: PEFT would load it onto the experts."""
    if targets != "all-linear" or not any(isinstance(m, Experts4bit) for m in model.modules()):
        return targets
    read_as_experts = peft_expert_names(getattr(getattr(model, "config", None), "model_type", ""))
    router = (router_class(model) or (type(None),))[0]
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and not isinstance(module, router)
                   and name.rsplit(".", 1)[-1] not in {"lm_head", *read_as_experts}})


def outside_the_layers(model: nn.Module) -> list[str] | None:
    """The linears all-linear leaves without LoRA: those outside the decoder layers (Gemma 4's
    per_layer_model_projection). Their LoRA would sit in FSDP2's root group, which stays gathered after a forward
    without backward, and an adapter saved then at world size 2 held zeros for it (tests/test_families.py)."""
    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and id(module) not in inside and not name.endswith("lm_head")]
    return names or None


def peft_expert_names(model_type: str) -> set[str]:
    """The transformers 4 module names PEFT turns into a fused experts parameter for this family (a list entry or a
    dotted suffix with such a name is moved to `target_parameters`, whichever module it named)."""
    from peft.utils import transformers_weight_conversion as conversion

    pattern = getattr(conversion, "_MODEL_TO_CONVERSION_PATTERN", {}).get(model_type)
    return set(getattr(conversion, "_MOE_TARGET_MODULE_MAPPING", {}).get(pattern, {}))


def refuse_expert_lora(model: peft.PeftModel, targets: str | list[str]) -> None:
    """PEFT maps the transformers 4 names of expert projections (gate_proj, w1, ...) onto the fused experts."""
    on_experts = sorted(getattr(model.peft_config["default"], "target_parameters", None) or [])
    if on_experts:
        raise ConfigError(f"lora.target_modules {targets!r} puts PEFT's LoRA on the experts or the router "
                          f"({on_experts}), which cannot add to 4-bit experts: name the attention projections, and "
                          "set lora.target_experts: true (and lora.train_router: true) for the experts")


def check_targets(model: nn.Module, targets: str | list[str]) -> None:
    """lora.target_modules must name some linear layer (PEFT's own error is a traceback). As in PEFT, a list
    entry matches a module name or its dotted suffix, a single string is a regular expression on the full name."""
    if targets == "all-linear":
        return
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]

    def wanted(name: str) -> bool:
        if isinstance(targets, str):
            return re.fullmatch(targets, name) is not None
        return any(name == target or name.endswith(f".{target}") for target in targets)

    if not any(wanted(name) for name in linears):
        leaves = sorted({name.rsplit(".", 1)[-1] for name in linears})
        raise ConfigError(f"lora.target_modules {targets!r} names no linear layer of this model; its linear layers "
                          f"are {leaves} (or use all-linear)")


def base_parameter_count(model: nn.Module) -> int:
    """The base model's parameters (global, not per shard; trained routers included, LoRA not); a 4-bit weight
    counts its unpacked size."""
    count, seen = 0, set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a head tied to the embeddings is one matrix
                continue
            seen.add(id(param))
            if not is_lora_tensor(f"{module_name}.{name}"):
                if isinstance(module, bnb.nn.Linear4bit) and name == "weight":  # packed: count the unpacked size
                    count += module.in_features * module.out_features
                elif isinstance(module, Experts4bit) and name in module.expert_matrices:
                    count += param.shape[0] * module.expert_matrices[name].numel
                else:
                    count += param.numel()
    return count


@contextmanager
def meta_dora_magnitudes() -> Iterator[None]:
    """PEFT sizes DoRA's magnitude by dequantizing the base weight, which does not exist on the meta device.

    Create it empty with the right shape instead; fill.py fills it with the weight's row norms.
    """
    original = DoraLinearLayer.update_layer

    def meta_update_layer(self: DoraLinearLayer, *, base_layer: nn.Module, lora_A: torch.Tensor,
                          lora_B: torch.Tensor, scaling: float, place_on_cpu: bool = False) -> None:
        self.weight = nn.Parameter(torch.empty(lora_B.shape[0], dtype=lora_A.dtype, device="meta"))

    # a deliberate patch of PEFT's method, undone on exit; mypy refuses any assignment to a method
    DoraLinearLayer.update_layer = meta_update_layer  # type: ignore[method-assign]
    try:
        yield
    finally:
        DoraLinearLayer.update_layer = original  # type: ignore[method-assign]


def refuse_unsupported(model: nn.Module) -> None:
    """A 3-D experts parameter left after the 4-bit swaps is a layout no 4-bit layer replaced (a short convolution's
    3-D weight, Qwen3.5's, is not an expert)."""
    for name, param in model.named_parameters():
        if param.ndim == 3 and ".experts." in f".{name}.":
            model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise ModelLoadError(f"{model_type} holds '{name}', a 3-D weight of a layout 4-bit loading does not know "
                                 "yet, so it would train unquantized")
