"""What trains in a mixture of experts besides the attention's LoRA: LoRA on every expert (`lora.target_experts`) and
the routers in full (`lora.train_router`), both saved as PEFT saves them, so PEFT, merge and generate read them.

PEFT's own LoRA on fused experts (`target_parameters`, its `ParamWrapper`) adds the whole update B A to the
parameter before the forward, which cannot be done to rows of 4-bit bytes. Here each hit expert instead adds
s (x A_e^T) B_e^T to its dequantized matmul, with PEFT's tensors and layout: lora_A [r * E, in] holds the experts one
after another, lora_B [out, r * E] interleaves them (column k * E + e is expert e's k-th rank). The routers train in
place, saved under their own names as PEFT's `modules_to_save` saves them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from qlora_fsdp.config import LoraConfig
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.layers.experts4bit import EXPERT_MATRICES, LORA_SUFFIX, Experts4bit, LoraUpdate, router_class
from qlora_fsdp.layers.lora_math import expert_factors, lora_scale


class ExpertLora(nn.Module):
    """LoRA on one fused expert parameter, in PEFT's layout; `enabled` is switched off for DPO's reference."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, lora: LoraConfig,
                 transposed: bool, x_meets_b_first: bool = False) -> None:
        super().__init__()
        self.n_experts, self.r = n_experts, lora.r
        self.transposed = transposed  # PEFT reads the experts as [in, out] (gpt-oss), as the merge needs to know
        # PEFT reads the matrix the other way round from how the forward multiplies it (Llama 4's, stored [in, out]
        # without transformers' flag that says so): x's update is then s (x B_e) A_e, the delta still B_e A_e
        self.x_meets_b_first = x_meets_b_first
        self.scaling = lora_scale(lora.r, lora.alpha, lora.use_rslora)
        self.compute_in_base_dtype = lora.compute_dtype == "base"
        dtype = TORCH_DTYPES[lora.dtype]
        self.lora_A = nn.Parameter(torch.empty(lora.r * n_experts, in_features, dtype=dtype, device="meta"))
        self.lora_B = nn.Parameter(torch.empty(out_features, lora.r * n_experts, dtype=dtype, device="meta"))
        self.enabled = True

    def updates(self, base_dtype: torch.dtype, group: int | None = None) -> list[LoraUpdate]:
        """One update an expert (or a group of `group` experts), cast once to the dtype lora.compute_dtype says."""
        dtype = base_dtype if self.compute_in_base_dtype else self.lora_A.dtype
        a, b = expert_factors(self.lora_A.to(dtype), self.lora_B.to(dtype), self.n_experts)
        if self.x_meets_b_first:
            a, b = b, a
        pieces = zip(a.unbind(), b.unbind(), strict=True) if group is None else zip(a.split(group), b.split(group),
                                                                                      strict=True)
        return [LoraUpdate(a_part, b_part, self.scaling) for a_part, b_part in pieces]


def peft_features(module: Experts4bit, name: str) -> tuple[int, int]:
    """(in, out) of an expert matrix as PEFT reads them: transformers 5 stores [out, in], gpt-oss [in, out] and says
    so; Llama 4 stores [in, out] and does not, so PEFT reads it as [out, in]."""
    rows, cols = module.expert_matrices[name].shape
    return (rows, cols) if peft_reads_transposed(module) else (cols, rows)


def peft_reads_transposed(module: Experts4bit) -> bool:
    return getattr(module, "peft_is_transposed", module.is_transposed)


def attach_expert_lora(model: nn.Module, lora: LoraConfig) -> int:
    """An ExpertLora beside each expert matrix of every 4-bit experts module; how many were attached."""
    attached = 0
    for owner, module in model.named_modules():
        if isinstance(module, Experts4bit):
            registered = [name for name, _ in module.named_parameters(recurse=False) if name in EXPERT_MATRICES]
            if registered != list(EXPERT_MATRICES):  # PEFT's nesting of the saved names follows this order
                raise ConfigError(f"lora.target_experts: '{owner}' registers its experts as {registered}, not "
                                  f"{list(EXPERT_MATRICES)}; leave lora.target_experts off for this model")
            for name in module.expert_matrices:
                n_experts = getattr(module, name).shape[0]
                peft_transposed = peft_reads_transposed(module)
                module.add_module(name + LORA_SUFFIX, ExpertLora(n_experts, *peft_features(module, name), lora,
                                                                 peft_transposed,
                                                                 peft_transposed != module.is_transposed))
                attached += 1
    return attached


@contextmanager
def expert_lora_off(model: nn.Module) -> Iterator[None]:
    """The experts without their LoRA (PEFT's disable_adapter does not know these modules)."""
    modules = [module for module in model.modules() if isinstance(module, ExpertLora)]
    for module in modules:
        module.enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.enabled = True


EXPERT_LORA_NAME = re.compile(rf"(.*)\.({'|'.join(EXPERT_MATRICES)}){LORA_SUFFIX}\.(lora_[AB])")


def peft_expert_key(name: str) -> str | None:
    """PEFT's name of an ExpertLora tensor (None for any other name).

    PEFT wraps one ParamWrapper around another for each targeted parameter of a module, the first registered
    innermost (attach_expert_lora checks the order): gate_up_proj's LoRA is `experts.base_layer.lora_A.weight`,
    down_proj's `experts.lora_A.weight`."""
    found = EXPERT_LORA_NAME.fullmatch(name)
    if found is None:
        return None
    owner, matrix, tensor = found.groups()
    depth = len(EXPERT_MATRICES) - 1 - EXPERT_MATRICES.index(matrix)
    return f"{owner}.{'base_layer.' * depth}{tensor}.weight"


def expert_loras(model: nn.Module) -> dict[str, ExpertLora]:
    """Our name of each fused expert parameter with LoRA -> its ExpertLora."""
    return {name.removesuffix(LORA_SUFFIX): module for name, module in model.named_modules()
            if isinstance(module, ExpertLora)}


def target_parameters(model: nn.Module) -> list[str]:
    """PEFT's `target_parameters` for the experts with LoRA: `mlp.experts.gate_up_proj`, as the decoder layer names
    them (PEFT matches them as suffixes), in the experts' registration order."""
    found: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, ExpertLora):
            owner, matrix_lora = name.rsplit(".", 1)
            suffix = ".".join(owner.split(".")[-2:] + [matrix_lora.removesuffix(LORA_SUFFIX)])
            if suffix not in found:
                found.append(suffix)
    return found


def routers(model: nn.Module) -> dict[str, nn.Module]:
    """The routers of a mixture of experts by name: the modules whose output transformers records as router logits."""

    found = router_class(model)
    if found is None:
        return {}
    return {name: module for name, module in model.named_modules() if isinstance(module, found[0])}


def train_routers(model: nn.Module, lora: LoraConfig) -> list[str]:
    """Make the routers trainable (in lora.dtype, computing in it); PEFT's `modules_to_save` names for them."""
    found = routers(model)
    dtype = TORCH_DTYPES[lora.dtype]
    for module in found.values():
        for param in module.parameters(recurse=False):
            param.requires_grad_(True)
            param.data = param.data.to(dtype)
        # the router's input is the model's dtype (bf16 on a GPU), its weights now lora.dtype
        module.register_forward_pre_hook(lambda mod, args: tuple(
            a.to(next(mod.parameters()).dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
    suffixes = sorted({".".join(name.split(".")[-2:]) for name in found})
    others = [name for name, module in model.named_modules()
              if name not in found and any(name.endswith(suffix) for suffix in suffixes)]
    if others:  # PEFT matches modules_to_save as plain suffixes of module names
        raise ConfigError(f"lora.train_router: the routers' names {suffixes} also end '{others[0]}', so PEFT could "
                          "not load the adapter; leave lora.train_router off for this model")
    return suffixes


def check_expert_training(model: nn.Module, lora: LoraConfig) -> None:
    """The MoE options make sense for this model and can be saved in a form PEFT loads."""
    has_experts = any(isinstance(module, Experts4bit) for module in model.modules())
    for key, wanted in (("lora.target_experts", lora.target_experts), ("lora.train_router", lora.train_router)):
        if wanted and not has_experts:
            raise ConfigError(f"{key}: true, but this model is not a mixture of experts; remove it")
    if lora.target_experts and (lora.dropout or lora.use_dora):
        raise ConfigError("lora.target_experts: PEFT's LoRA on experts has no dropout or DoRA (it could not load "
                          "the adapter); set lora.dropout: 0 and lora.use_dora: false")
