"""4-bit experts for mixtures of experts (Qwen3-MoE, Mixtral, gpt-oss and the other transformers 5 families).

transformers keeps a layer's experts as fused 3-D parameters (`gate_up_proj [E, ...]`, `down_proj [E, ...]`), which
bitsandbytes cannot quantize (it swaps `nn.Linear` only). Here each expert matrix is quantized on its own with the
settings of the dense weights, and one expert is one row of bytes: its packed 4-bit values, then its block
statistics (double quantization's nested statistics and offset included), all as uint8. FSDP2 shards the rows
over the experts (dim 0), gathers and never casts them, whatever the mixed-precision policy.

In a forward only the experts the router picked are dequantized, one at a time, and the dequantized matrix is not
kept for the backward: the backward dequantizes it again (as bitsandbytes' own 4-bit matmul does), so no bf16
copy of the experts outlives one expert's matmul. The router, the expert biases and the family's gate activation
(gpt-oss's clamped, interleaved one included) are the model's own.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import bitsandbytes.functional as bnbf
import torch
import torch.nn.functional as F
from torch import nn

from qlora_fsdp.config import QuantConfig
from qlora_fsdp.errors import ModelLoadError
from qlora_fsdp.families import experts_per_token

EXPERT_MATRICES = ("gate_up_proj", "down_proj")
LORA_SUFFIX = "_lora"  # an expert matrix's LoRA (expert_lora.ExpertLora) sits beside it: `down_proj_lora`
NESTED_BLOCKSIZE = 256  # bitsandbytes' block size for the statistics of double quantization
_CODES: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}


@dataclass(frozen=True)
class ExpertMatrix:
    """One expert's matrix of a fused parameter: its shape as transformers stores it and how its row of bytes is
    laid out (packed values | absmax | nested absmax | offset; the last two with double quantization only)."""

    shape: tuple[int, int]
    blocksize: int
    double_quant: bool
    quant_type: str
    dtype: torch.dtype  # what dequantization gives: the model's dtype

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def n_blocks(self) -> int:
        return self.numel // self.blocksize

    @property
    def n_nested(self) -> int:
        return math.ceil(self.n_blocks / NESTED_BLOCKSIZE) if self.double_quant else 0

    @property
    def absmax_bytes(self) -> int:
        return self.n_blocks * (1 if self.double_quant else 4)

    @property
    def row_bytes(self) -> int:
        return self.numel // 2 + self.absmax_bytes + 4 * self.n_nested + 4 * self.double_quant

    def to_row(self, weight: torch.Tensor) -> torch.Tensor:
        """Quantize one expert's matrix into its row of bytes."""
        packed, state = bnbf.quantize_4bit(weight.contiguous(), blocksize=self.blocksize,
                                           compress_statistics=self.double_quant, quant_type=self.quant_type,
                                           quant_storage=torch.uint8)
        parts = [packed.flatten(), as_bytes(state.absmax)]
        if self.double_quant:
            parts += [as_bytes(state.state2.absmax.float()), as_bytes(state.offset.float().reshape(1))]
        return torch.cat(parts)

    def quant_state(self, row: torch.Tensor) -> bnbf.QuantState:
        """bitsandbytes' state for a row of bytes (views into the row, nothing copied)."""
        code, nested_code = codes(self.quant_type, row.device)
        packed_end = self.numel // 2
        absmax_end = packed_end + self.absmax_bytes
        if not self.double_quant:
            return bnbf.QuantState(absmax=row[packed_end:absmax_end].view(torch.float32), shape=torch.Size(self.shape),
                                   code=code, blocksize=self.blocksize, quant_type=self.quant_type, dtype=self.dtype)
        nested_end = absmax_end + 4 * self.n_nested
        nested = bnbf.QuantState(absmax=row[absmax_end:nested_end].view(torch.float32), code=nested_code,
                                 blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
        return bnbf.QuantState(absmax=row[packed_end:absmax_end], shape=torch.Size(self.shape), code=code,
                               blocksize=self.blocksize, quant_type=self.quant_type, dtype=self.dtype,
                               offset=row[nested_end:].view(torch.float32)[0], state2=nested)

    def dequantize(self, row: torch.Tensor) -> torch.Tensor:
        return bnbf.dequantize_4bit(row[: self.numel // 2].view(-1, 1), self.quant_state(row))



def shaped_quant_state(shape: tuple[int, int], blocksize: int, double_quant: bool, quant_type: str,
                       dtype: torch.dtype) -> bnbf.QuantState:
    """A quantization state with the shapes quantize_4bit gives a weight of `shape`, for fake tensors (its own values
    cannot be faked: bitsandbytes builds the 8-bit code table from Python numbers)."""
    blocks = -(-shape[0] * shape[1] // blocksize)
    common = {"shape": torch.Size(shape), "code": torch.empty(16), "blocksize": blocksize, "quant_type": quant_type,
              "dtype": dtype}
    if not double_quant:
        return bnbf.QuantState(absmax=torch.empty(blocks), **common)
    nested = bnbf.QuantState(absmax=torch.empty(-(-blocks // NESTED_BLOCKSIZE)), code=torch.empty(256),
                             blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
    return bnbf.QuantState(absmax=torch.empty(blocks, dtype=torch.uint8), offset=torch.empty(()), state2=nested,
                           **common)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().flatten().view(torch.uint8)


def codes(quant_type: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit code book and double quantization's 8-bit one (constants: made once per device; made on the CPU
    outside any fake mode, and in the planner's fake mode copied, not cached)."""
    key = (quant_type, str(device))
    if key in _CODES:
        return _CODES[key]
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    with unset_fake_temporarily():
        on_cpu = bnbf.get_4bit_type(quant_type, device="cpu"), bnbf.create_dynamic_map(signed=True)
    made = on_cpu[0].to(device), on_cpu[1].to(device)
    if not is_fake(made[0]):
        _CODES[key] = made
    return made


class DequantizedMatmul(torch.autograd.Function):
    """x times one expert's 4-bit matrix; the backward dequantizes again instead of keeping the matrix."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, row: torch.Tensor, matrix: ExpertMatrix, transposed: bool) -> torch.Tensor:
        ctx.save_for_backward(row)
        ctx.matrix, ctx.transposed = matrix, transposed
        weight = matrix.dequantize(row).to(x.dtype)
        return x @ weight if transposed else F.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (row,) = ctx.saved_tensors
        weight = ctx.matrix.dequantize(row).to(grad.dtype)
        return (grad @ weight.t() if ctx.transposed else grad @ weight), None, None, None


class Experts4bit(nn.Module):
    """Mixed into a transformers experts class: its fused parameters hold rows of bytes, its forward is ours.

    Everything else (the gate activation `_apply_gate`, the biases, the layout flags) is the family's own."""

    expert_matrices: dict[str, ExpertMatrix]
    is_transposed: bool
    has_bias: bool
    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    _apply_gate: Callable[[torch.Tensor], torch.Tensor]  # the family's own (an annotation: it must not shadow it)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        routes = Routes.of(top_k_index, self.gate_up_proj.shape[0])
        grouped = hidden_states.index_select(0, routes.tokens).split(routes.counts)  # one gather, grouped by expert
        updates = self.lora_updates(hidden_states.dtype)
        outputs = [self.expert_mlp(expert, rows, {name: per_expert[expert] for name, per_expert in updates.items()})
                   for expert, rows in zip(routes.experts, grouped, strict=True)]
        weighted = torch.cat(outputs) * top_k_weights.flatten()[routes.order, None]
        # one scatter; per token its experts' outputs are added in ascending expert order, as transformers adds them
        return torch.zeros_like(hidden_states).index_add_(0, routes.tokens, weighted.to(hidden_states.dtype))

    def idle_parameters(self) -> int:
        """Expert elements a token does not use (all but top-k of the experts): what `active` parameters leave out."""
        n_experts = self.gate_up_proj.shape[0]
        top_k = experts_per_token(getattr(self, "config", None), n_experts)
        return (n_experts - top_k) * sum(matrix.numel for matrix in self.expert_matrices.values())

    def lora_updates(self, dtype: torch.dtype, group: int | None = None) -> dict[str, list[LoraUpdate]]:
        """Each expert matrix's LoRA (lora.target_experts, switched on), cut once a forward into one update an expert
        (or a planner's group), so the backward gathers their gradients in one tensor."""
        updates = {}
        for name in self.expert_matrices:
            lora = getattr(self, name + LORA_SUFFIX, None)
            if lora is not None and lora.enabled:
                updates[name] = lora.updates(dtype, group)
        return updates

    def expert_mlp(self, expert: int, x: torch.Tensor,
                   lora: dict[str, LoraUpdate] | None = None) -> torch.Tensor:
        lora = lora or {}
        hidden = self.expert_linear("gate_up_proj", expert, x, lora.get("gate_up_proj"))
        return self.expert_linear("down_proj", expert, self._apply_gate(hidden), lora.get("down_proj"))

    def expert_linear(self, name: str, expert: int, x: torch.Tensor, lora: LoraUpdate | None = None) -> torch.Tensor:
        """x times one expert's matrix, plus its LoRA update."""
        rows = getattr(self, name)
        y = DequantizedMatmul.apply(x, rows[expert], self.expert_matrices[name], self.is_transposed)
        if lora is not None:
            y = y + lora(x)
        if self.has_bias:
            y = y + getattr(self, f"{name}_bias")[expert]
        return y


class StackedExperts4bit(Experts4bit):
    """Experts called with every expert's rows stacked, each row already scaled by its router score and zero where
    the router did not pick the expert (Llama 4: `[E * tokens, hidden]` in, the same out). Only the nonzero rows are
    run: a zero row gives a zero output and a zero gradient (act(0) = 0 for the families' activations), so this is
    the dense computation's result without its E-fold work."""

    act_fn: Callable[[torch.Tensor], torch.Tensor]  # the family's own (an annotation: it must not shadow it)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return up * self.act_fn(gate)  # as Llama4TextExperts multiplies

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        n_experts = self.gate_up_proj.shape[0]
        with torch.no_grad():
            picked = hidden_states.view(n_experts, -1, hidden_states.shape[-1]).ne(0).any(-1)
            counts = picked.sum(-1).tolist()  # the one sync
            rows = picked.flatten().nonzero().squeeze(1)
        grouped = hidden_states.index_select(0, rows).split(counts)
        updates = self.lora_updates(hidden_states.dtype)
        outputs = [self.expert_mlp(expert, x, {name: per_expert[expert] for name, per_expert in updates.items()})
                   for expert, x in enumerate(grouped) if counts[expert]]
        if not outputs:
            return torch.zeros_like(hidden_states)
        return torch.zeros_like(hidden_states).index_copy(0, rows, torch.cat(outputs).to(hidden_states.dtype))


@dataclass
class LoraUpdate:
    """s (x A_e^T) B_e^T of one expert (a [r, in], b [r, out]) or of a planner's group (a [group, r, in], ...)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ((x.to(self.a.dtype) @ self.a.mT) @ self.b * self.scaling).to(x.dtype)


@dataclass
class Routes:
    """The (token, slot) pairs of a batch grouped by expert: `order` sorts the flattened top-k choices by expert
    (stable: by token within an expert), `tokens` is the token of each, `counts` the rows of each hit expert."""

    order: torch.Tensor
    tokens: torch.Tensor
    experts: list[int]
    counts: list[int]

    @staticmethod
    def of(top_k_index: torch.Tensor, n_experts: int) -> Routes:
        top_k = top_k_index.shape[1]
        with torch.no_grad():
            flat = top_k_index.flatten()
            order = torch.argsort(flat, stable=True)
            per_expert = torch.bincount(flat, minlength=n_experts).tolist()  # the one sync, as in transformers
        hit = [(expert, count) for expert, count in enumerate(per_expert) if count]
        return Routes(order, order // top_k, [e for e, _ in hit], [c for _, c in hit])


# ---- building: swap a family's experts for 4-bit ones --------------------------------------------------------

def is_experts_module(module: nn.Module) -> bool:
    """transformers' fused experts: 3-D `gate_up_proj` and `down_proj` parameters."""
    params = [getattr(module, name, None) for name in EXPERT_MATRICES]
    return all(isinstance(p, nn.Parameter) and p.ndim == 3 for p in params)


def quantize_experts(model: nn.Module, quant: QuantConfig) -> int:
    """Give every experts module meta rows of bytes and our forward; the number of experts modules swapped."""
    swapped = 0
    built: Any = model  # a transformers model: its config
    for name, module in model.named_modules():
        if is_experts_module(module):
            if is_stacked(module):
                adopt_stacked_layout(module, built.config.get_text_config())
            check_supported(name, module)
            make_4bit(module, quant)
            swapped += 1
    return swapped


def is_stacked(module: nn.Module) -> bool:
    """Experts whose forward takes one argument, the stacked rows of every expert (Llama 4's), not transformers'
    (hidden_states, top_k_index, top_k_weights)."""
    return list(inspect.signature(type(module).forward).parameters) == ["self", "hidden_states"]


def adopt_stacked_layout(module: nn.Module, config: Any) -> None:
    """The layout flags transformers' decorated experts carry, for a stacked class that lacks them: checked against
    the shapes, `[E, hidden, 2 * inner]` then `[E, inner, hidden]` (x @ W), gate before up, no biases."""
    experts: Any = module  # its 3-D parameters, found by is_experts_module
    gate_up, down = experts.gate_up_proj.shape, experts.down_proj.shape
    if not (gate_up[1] == down[2] and gate_up[2] == 2 * down[1]) or hasattr(module, "gate_up_proj_bias"):
        raise ModelLoadError(f"{type(module).__name__}: stacked experts of shapes {tuple(gate_up)} and {tuple(down)} "
                             "are not the [E, hidden, 2*inner] / [E, inner, hidden] layout read in 4-bit")
    # PEFT, finding no flag, reads such experts as [E, out, in] (its adapters for them are laid out so)
    vars(module).update(has_gate=True, has_bias=False, is_transposed=True, is_concatenated=True,
                        peft_is_transposed=False)
    vars(module).setdefault("config", config)  # the top-k that idle_parameters counts with


def check_supported(name: str, module: nn.Module) -> None:
    family = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    has_gate_function = hasattr(module, "_apply_gate") or is_stacked(module)  # the stacked ones get ours
    if not has_gate_function or not getattr(module, "has_gate", False):
        raise ModelLoadError(f"{family}: experts without a gated projection ('{name}') are not supported in 4-bit")
    if getattr(module, "has_post_expert_norm", False):
        raise ModelLoadError(f"{family}: experts with a norm after each expert ('{name}') are not supported in 4-bit")


_CLASSES: dict[type, type] = {}


def make_4bit(module: nn.Module, quant: QuantConfig) -> None:
    matrices = {}
    for name in EXPERT_MATRICES:
        param = getattr(module, name)
        matrix = ExpertMatrix((param.shape[1], param.shape[2]), quant.blocksize, quant.double_quant,
                              quant.quant_type, param.dtype)
        if matrix.numel % quant.blocksize:
            raise ModelLoadError(f"an expert matrix of {matrix.shape} is not a multiple of the quantization "
                                 f"blocksize {quant.blocksize}")
        matrices[name] = matrix
        setattr(module, name, nn.Parameter(torch.empty(param.shape[0], matrix.row_bytes, dtype=torch.uint8,
                                                       device="meta"), requires_grad=False))
    vars(module)["expert_matrices"] = matrices
    base = type(module)
    if base not in _CLASSES:
        ours = StackedExperts4bit if is_stacked(module) else Experts4bit
        _CLASSES[base] = type(f"{base.__name__}4bit", (ours, base), {})
    module.__class__ = _CLASSES[base]


def router_class(model: nn.Module) -> tuple[type[nn.Module], int] | None:
    """The router module's class and which of its outputs are the logits, as transformers records them."""
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            return recorder.target_class, recorder.index
    return None
