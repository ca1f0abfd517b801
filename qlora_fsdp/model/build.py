"""Build the model on the meta device, swap linears for NF4 `Linear4bit`, attach LoRA/DoRA.

No weight is read here and nothing here knows about ranks: `loading.py` fills the (possibly sharded)
parameters afterwards, one tensor at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import bitsandbytes as bnb
import peft
import torch
from accelerate import init_empty_weights
from peft.tuners.lora.dora import DoraLinearLayer
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from qlora_fsdp.config import Config, LoraConfig, QuantConfig
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.errors import ConfigError, ModelLoadError, first_line
from qlora_fsdp.model import expert_training, quantized_forms
from qlora_fsdp.model.attention import transformers_name
from qlora_fsdp.model.experts4bit import Experts4bit, quantize_experts
from qlora_fsdp.model.families import (
    CheckpointLayout,
    checkpoint_layout,
    refuse_unsupported,
    run_mixers_per_sample,
    text_config,
)
from qlora_fsdp.model.fused_lora import fuse_lora_projections
from qlora_fsdp.model.names import is_lora_tensor
from qlora_fsdp.model.weight_files import stored_keys

# 4-bit values are packed two to a byte and stored as raw bytes. FSDP2 never casts a non-float parameter and
# all-gathers it as bytes, whatever the mixed-precision policy or the LoRA dtype. The earlier bf16 storage was
# not safe: on CUDA (sm80+) FSDP2's all-gather copy-in reads bf16 through float and rewrites every bf16 NaN bit
# pattern as 0x7FFF, so about 0.1% of the packed bytes decode to other 4-bit values whenever a layer's
# all-gather is uniformly bf16 (bitsandbytes #1945, pytorch #159333; emulated on CPU in tests/test_numerics.py).
QUANT_STORAGE = torch.uint8


def model_dir(model_path: str) -> Path:
    """A local checkpoint folder as is; otherwise a hub id, fetched (config, tokenizer and safetensors only)."""
    path = Path(model_path)
    if path.is_dir():
        return path
    if path.exists() or model_path.startswith((".", "/")) or model_path.count("/") > 1:
        raise ModelLoadError(f"model.path '{model_path}' is not a checkpoint folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as err:  # offline, gated or unknown: say which, in one line
        raise ModelLoadError(f"model.path '{model_path}' is neither a local folder nor reachable on the hub "
                             f"({type(err).__name__}); for the tiny default run `make tiny-model`") from None


def base_model_dir(cfg: Config) -> Path:
    """model.path as a folder with a config.json (asked first: without one, a tokenizer load fails obscurely)."""
    path = model_dir(cfg.model.path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face checkpoint folder (point model.path "
                             "at the folder holding config.json, the tokenizer and the *.safetensors)")
    try:
        json.loads((path / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as err:  # transformers' own message names neither line nor cause
        raise ModelLoadError(f"{path / 'config.json'}: not valid JSON ({first_line(err)})") from None
    return path


def load_hf_config(cfg: Config) -> PretrainedConfig:
    path = base_model_dir(cfg)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except ValueError as err:  # JSON that is not a config, an unknown model_type, remote code refused
        raise ModelLoadError(f"{path / 'config.json'}: {first_line(err)}") from None
    quantized_forms.refuse_untrainable_form(config, path / "config.json")
    quantized_forms.refuse_contradicting_recipe(config, cfg.quant, path / "config.json")
    text = text_config(config)  # a multimodal checkpoint trains its text model
    if text is not config and getattr(config, "quantization_config", None) is not None:
        text.quantization_config = config.quantization_config  # how the whole checkpoint is stored
    return text


def load_tokenizer(cfg: Config) -> PreTrainedTokenizerBase:
    path = base_model_dir(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError, TypeError) as err:  # no or broken tokenizer files
        raise ModelLoadError(f"{path}: cannot load its tokenizer ({first_line(err)}); the folder needs "
                             "tokenizer.json or the tokenizer files of its model family") from None
    if tokenizer.pad_token is None:  # Llama 3 ships none; padding is masked out of loss and attention
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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
    model.tie_weights()  # transformers ties the head to the embeddings only when it made the parameters itself
    layout = checkpoint_layout(checkpoint_folder(cfg), model, cfg.model.trust_remote_code)
    run_mixers_per_sample(decoder_layers(model))
    swap_linears_for_4bit(model, cfg.quant, stored_4bit_linears(checkpoint_folder(cfg), layout))
    quantize_experts(model, cfg.quant)
    refuse_mxfp4_dense(model, hf_config)
    refuse_unsupported(model)
    model.requires_grad_(False)
    model.config.use_cache = False  # no KV cache while training
    peft_model = attach_lora(model, cfg.lora)
    vars(peft_model)["checkpoint_layout"] = layout  # a plain attribute: read by loading, the adapter and merge
    return peft_model


def checkpoint_folder(cfg: Config) -> Path | None:
    """The folder whose weights will be read; None for random weights (a hub id is then not fetched)."""
    path = Path(cfg.model.path)
    if path.is_dir():
        return path
    return None if cfg.model.init == "random" else model_dir(cfg.model.path)


def stored_4bit_linears(folder: Path | None, layout: CheckpointLayout) -> set[str] | None:
    """The linear layers a pre-quantized checkpoint stores in 4-bit (our module names); None for a checkpoint that
    stores none (its linears are quantized at load, all but quant.skip_modules)."""
    if folder is None or not any(folder.glob("*.safetensors")):
        return None
    keys = quantized_forms.quantized_weight_keys(stored_keys(folder))
    if not keys:
        return None
    ours = {layout.model_key(key)[0] for key in keys}
    return {key.removesuffix(".weight") for key in ours if key is not None}


def swap_linears_for_4bit(model: nn.Module, quant: QuantConfig, stored_4bit: set[str] | None = None) -> None:
    """Replace every nn.Linear but the skipped ones with a meta `Linear4bit` of the packed shape; for a pre-quantized
    checkpoint exactly those it stores in 4-bit (the others it keeps unquantized, and so does training)."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
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


def refuse_mxfp4_dense(model: nn.Module, hf_config: PretrainedConfig) -> None:
    """MXFP4 is trained from where gpt-oss uses it, on the experts (decoded, then NF4); not on dense weights."""
    if quantized_forms.quant_method(hf_config) == "mxfp4" and not any(isinstance(m, Experts4bit)
                                                                      for m in model.modules()):
        raise ModelLoadError(f"{hf_config.model_type}: config.json says its weights are stored in MXFP4 and it has no "
                             "experts: MXFP4 dense weights are not supported; use the unquantized checkpoint")


def attach_lora(model: nn.Module, lora: LoraConfig) -> peft.PeftModel:
    targets = lora_targets(model, lora.target_modules)
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        use_dora=lora.use_dora,
        use_rslora=lora.use_rslora,  # saved in adapter_config.json, so PEFT and the merge scale alike
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=False,  # weights are meta now; loading.py initializes them, the same on any world size
    )
    check_targets(model, targets)
    with meta_dora_magnitudes():
        model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    refuse_expert_lora(model, targets)
    add_expert_training(model, lora)
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(TORCH_DTYPES[lora.dtype])
    fuse_lora_projections(model, lora)
    return model


def add_expert_training(model: peft.PeftModel, lora: LoraConfig) -> None:
    """lora.target_experts and lora.train_router, recorded in the adapter's config as PEFT would record them."""
    expert_training.check_expert_training(model, lora)
    config = model.peft_config["default"]
    assert isinstance(config, peft.LoraConfig), "attach_lora makes the adapter from a peft.LoraConfig"
    if lora.target_experts:
        expert_training.attach_expert_lora(model, lora)
        config.target_parameters = expert_training.target_parameters(model)
    if lora.train_router:
        config.modules_to_save = expert_training.train_routers(model, lora)


def lora_targets(model: nn.Module, targets: str | list[str]) -> str | list[str]:
    """all-linear on a mixture of experts means its linear layers (attention, dense MLPs): PEFT would otherwise add
    the experts and the router, as the linear layers of the model's transformers 4 layout."""
    if targets != "all-linear" or not any(isinstance(m, Experts4bit) for m in model.modules()):
        return targets
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head"})


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


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found from the model (its `_no_split_modules`, else the longest ModuleList)."""
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    # by the class or a base of it: fully_shard swaps a module's class for a subclass (FSDPLlamaDecoderLayer)
    layers = [m for m in base.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if layers:
        return layers
    lists = [m for m in base.modules() if isinstance(m, nn.ModuleList) and len({type(c) for c in m}) == 1]
    if not lists:
        raise ModelLoadError(f"cannot find the decoder layers of {type(base).__name__}")
    longest: nn.ModuleList = max(lists, key=len)
    return list(longest)


@contextmanager
def meta_dora_magnitudes() -> Iterator[None]:
    """PEFT sizes DoRA's magnitude by dequantizing the base weight, which does not exist on the meta device.

    Create it empty with the right shape instead; loading.py fills it with the weight's row norms.
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
