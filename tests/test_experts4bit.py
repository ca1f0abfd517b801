"""The 4-bit experts' pieces on their own (one process, no ranks): the row of bytes, the matmul that dequantizes twice,
the grouping of routed tokens, the whole experts module against the family's own on the rounded matrices, the
trained routers' dtype, and the planner's stand-in, which must count the work of training's expert loop."""

from __future__ import annotations

import collections
import copy

import bitsandbytes.functional as bnbf
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from qlora_fsdp.config import LoraConfig, QuantConfig
from qlora_fsdp.layers.expert_lora import ExpertLora, attach_expert_lora, train_routers
from qlora_fsdp.layers.experts4bit import DequantizedMatmul, ExpertMatrix, Experts4bit, Routes, make_4bit
from qlora_fsdp.measure.fake_experts import planned_forward
from qlora_fsdp.measure.op_work import Work, op_work
from tests.helpers import assert_close_to_summation_order


@pytest.mark.parametrize("double_quant", [True, False])
def test_an_expert_row_decodes_as_bitsandbytes_rounds_the_matrix(double_quant):
    weight = torch.randn(96, 64)
    matrix = ExpertMatrix((96, 64), 64, double_quant, "nf4", torch.float32)
    row = matrix.to_row(weight)
    assert row.dtype == torch.uint8 and row.shape == (matrix.row_bytes,)
    packed, state = bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=double_quant, quant_type="nf4",
                                       quant_storage=torch.uint8)
    assert torch.equal(matrix.dequantize(row), bnbf.dequantize_4bit(packed, state))


@pytest.mark.parametrize("transposed", [False, True])
def test_the_dequantizing_matmul_gives_the_gradient_of_the_rounded_matrix(transposed):
    matrix = ExpertMatrix((48, 64), 64, True, "nf4", torch.float32)
    row = matrix.to_row(torch.randn(48, 64))
    dense = matrix.dequantize(row)
    x = torch.randn(5, 48 if transposed else 64, requires_grad=True)
    ours = DequantizedMatmul.apply(x, row, matrix, transposed)
    grad = torch.randn_like(ours)
    (expected_grad,) = torch.autograd.grad((x @ dense if transposed else x @ dense.t()), x, grad)
    (our_grad,) = torch.autograd.grad(ours, x, grad)
    assert torch.equal(ours, x @ dense if transposed else torch.nn.functional.linear(x, dense))
    assert torch.allclose(our_grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_routes_group_each_experts_tokens_in_token_order():
    top_k_index = torch.tensor([[2, 0], [0, 3], [2, 3]])
    routes = Routes.of(top_k_index, n_experts=5)
    assert routes.experts == [0, 2, 3] and routes.counts == [2, 2, 2]  # expert 1 and 4 not hit: not run
    assert routes.tokens.tolist() == [0, 1, 0, 2, 1, 2]
    assert top_k_index.flatten()[routes.order].tolist() == [0, 0, 2, 2, 3, 3]


def experts_of(family: str) -> torch.nn.Module:
    """The family's own experts module (4 experts, 2 a token), random weights; gpt-oss stores x @ W's W and biases."""
    shapes = dict(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    experts_class = GptOssExperts if family == "gpt_oss" else MixtralExperts
    module = experts_class(AutoConfig.for_model(family, **shapes))
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, 0.1)
    return module


def rounded_through_nf4(module: torch.nn.Module) -> torch.nn.Module:
    """A copy whose every expert matrix is what bitsandbytes' quantize_4bit and dequantize_4bit make of it (the
    recipe's defaults: NF4, blocks of 64, double quantization)."""
    rounded = copy.deepcopy(module)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            for expert in getattr(rounded, name):
                packed, state = bnbf.quantize_4bit(expert.contiguous(), blocksize=64, compress_statistics=True,
                                                   quant_type="nf4", quant_storage=torch.uint8)
                expert.copy_(bnbf.dequantize_4bit(packed, state))
    return rounded


def as_4bit(module: torch.nn.Module) -> Experts4bit:
    """Our 4-bit experts of the same weights: one row of bytes an expert, as loading fills them."""
    ours = copy.deepcopy(module).requires_grad_(False)
    make_4bit(ours, QuantConfig())
    assert isinstance(ours, Experts4bit)
    for name, matrix in ours.expert_matrices.items():
        rows = torch.stack([matrix.to_row(expert) for expert in getattr(module, name).detach()])
        setattr(ours, name, torch.nn.Parameter(rows, requires_grad=False))
    return ours


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_4bit_experts_compute_the_familys_experts_on_the_rounded_matrices(family):
    """Outputs, and the gradients of the hidden states and of the routing weights (the backward dequantizes again),
    against the family's own module holding the matrices bitsandbytes' round trip gives."""
    module, generator = experts_of(family), torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(12)])  # 12 tokens, 2 experts each
    routing = torch.softmax(torch.randn(12, 2, generator=generator), dim=-1)
    hidden, grad = torch.randn(12, 64, generator=generator), torch.randn(12, 64, generator=generator)
    results = []
    for experts in (rounded_through_nf4(module), as_4bit(module)):
        inputs = hidden.clone().requires_grad_(), routing.clone().requires_grad_()
        out = experts(inputs[0], index, inputs[1])
        out.backward(grad)
        results.append((out.detach(), inputs[0].grad, inputs[1].grad))
    (expected, expected_hidden, expected_routing), (ours, our_hidden, our_routing) = results
    assert expected.abs().max() > 0.01
    # the same matrices, their products summed in another order (64: the hidden and intermediate sizes)
    for got, want in ((ours, expected), (our_hidden, expected_hidden), (our_routing, expected_routing)):
        assert_close_to_summation_order(got, want, 64)


def test_trained_routers_compute_in_lora_dtype_and_pass_their_gradient_down():
    """lora.train_router in a bf16 model: the router's weights become fp32 (lora.dtype) and its bf16 input is cast
    up on the way in, as part of the graph, so the layers below still get the router's gradient."""
    config = AutoConfig.for_model("qwen3_moe", hidden_size=64, moe_intermediate_size=64, num_experts=4,
                                  num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=32)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    assert train_routers(model, LoraConfig()) == ["mlp.gate"]
    weight = model.model.layers[0].mlp.gate.weight
    assert weight.dtype == torch.float32 and weight.requires_grad
    hidden = torch.randn(5, 64, dtype=torch.bfloat16, requires_grad=True)
    logits = model.model.layers[0].mlp.gate(hidden)[0]
    assert logits.dtype == torch.float32
    assert torch.equal(logits, F.linear(hidden.detach().float(), weight.detach()))
    grad = torch.randn_like(logits)
    logits.backward(grad)
    assert hidden.grad is not None, "the router's input is cut from the graph: nothing below learns from routing"
    torch.testing.assert_close(hidden.grad, (grad @ weight.detach()).to(torch.bfloat16))
    torch.testing.assert_close(weight.grad, grad.t() @ hidden.detach().float())


class CountWork(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.work, self.ops = Work(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.work.add(op_work(func, args, kwargs or {}, out, "forward", False, None))
        self.ops[func] += 1
        return out


def fake_experts(family: str, with_lora: bool = False) -> Experts4bit:
    """A 4-bit experts module of 32 experts with fake rows of bytes (sizes at which a call's constant bytes, the
    code books, are a small part of its work, as in a real model), and LoRA on every expert if asked."""
    if family == "gpt_oss":
        config = AutoConfig.for_model("gpt_oss", hidden_size=256, intermediate_size=256, num_local_experts=32,
                                      num_experts_per_tok=4)
        module: torch.nn.Module = GptOssExperts(config)
    else:
        config = AutoConfig.for_model("qwen3_moe", hidden_size=256, moe_intermediate_size=256, num_experts=32,
                                      num_experts_per_tok=4)
        module = Qwen3MoeExperts(config)
    module.requires_grad_(False)  # frozen, as build_meta_model leaves every base parameter (gpt-oss's biases too)
    make_4bit(module, QuantConfig())
    for name in ("gate_up_proj", "down_proj"):
        setattr(module, name, torch.nn.Parameter(torch.empty(getattr(module, name).shape, dtype=torch.uint8),
                                                 requires_grad=False))
    assert isinstance(module, Experts4bit)
    if with_lora:
        attach_expert_lora(module, LoraConfig(r=4))
        for lora in module.modules():
            if isinstance(lora, ExpertLora):
                lora.lora_A, lora.lora_B = (torch.nn.Parameter(torch.empty(p.shape)) for p in (lora.lora_A,
                                                                                                  lora.lora_B))
    return module


@pytest.mark.old_torch  # reaches torch code that differs between releases (tests/version_paths.py)
@pytest.mark.parametrize(("family", "with_lora"), [("qwen3_moe", False), ("gpt_oss", False), ("gpt_oss", True)])
def test_the_planners_grouped_experts_count_the_work_of_trainings_loop(family, with_lora):
    """On fake tensors the plan runs 16 experts an op; its FLOPs, dequantized elements and bytes moved must be those
    of training's loop over the same (evenly routed) experts, in far fewer ops (LoRA on the experts included)."""
    tokens, top_k = 64, 4
    counted = {}
    for path in ("loop", "planned"):
        with FakeTensorMode(allow_non_fake_inputs=True):
            experts = fake_experts(family, with_lora)
            hidden = torch.empty(tokens, 256, requires_grad=True)
            weights = torch.empty(tokens, top_k)
            with CountWork() as count:
                if path == "planned":
                    out = planned_forward(experts, hidden, torch.empty(tokens, top_k, dtype=torch.long), weights)
                else:  # the training path, with the planner's even routing: 8 rows for each of the 32 experts
                    order = torch.arange(tokens * top_k)
                    routes = Routes(order, order // top_k, list(range(32)), [8] * 32)
                    rows = hidden[routes.tokens].split(routes.counts)
                    updates = experts.lora_updates(hidden.dtype)
                    outputs = [experts.expert_mlp(e, r, {name: per_expert[e] for name, per_expert in updates.items()})
                               for e, r in zip(routes.experts, rows, strict=True)]
                    weighted = torch.cat(outputs) * weights.flatten()[routes.order, None]
                    out = torch.zeros_like(hidden).index_add_(0, routes.tokens, weighted)
                out.sum().backward()
        counted[path] = count
    loop, planned = counted["loop"].work, counted["planned"].work
    assert planned.matmul_flops == loop.matmul_flops > 0
    assert planned.dequant_elements == loop.dequant_elements > 0
    assert planned.memory_bytes == pytest.approx(loop.memory_bytes, rel=0.02)
    assert sum(counted["planned"].ops.values()) < sum(counted["loop"].ops.values()) / 4
