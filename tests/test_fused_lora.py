"""Fused LoRA projections (q/k/v and gate/up share one cast and one stacked A matmul) give PEFT's own
per-projection loss and gradients: fp32, equal to summation order (tests.helpers.fp32_reordering_bound), under
FSDP2 on 2 ranks, with DoRA, rsLoRA, dropout, every checkpointing scope, CPU and activation offload and packed rows;
`lora.compute_dtype: base` runs the LoRA matmuls in bf16 with fp32 gradients. (Compiled layers:
tests/test_compile.py.)"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from qlora_fsdp.data.batching import collate_packed
from qlora_fsdp.layers.fused_lora import SharedInput
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.objectives.supervised import accumulate_gradients
from tests.helpers import (
    batches,
    fp32_reordering_bound,
    full_grads,
    relative_difference,
    run_ranks_sequence,
    tiny_config,
    variable_length_samples,
)

PAD = 2
# (name, config sections): each run with lora.fuse_projections on and off
SETUPS = [
    ("LoRA, every layer checkpointed", {}),
    ("DoRA", {"lora": {"use_dora": True}}),
    ("rsLoRA, r 8 alpha 32", {"lora": {"use_rslora": True, "r": 8, "alpha": 32}}),
    ("dropout 0.1 (a mask per projection)", {"lora": {"dropout": 0.1}}),
    ("no checkpointing", {"activation_checkpointing": {"mode": "off"}}),
    ("attention scope", {"activation_checkpointing": {"scope": "attention"}}),
    ("MLP scope", {"activation_checkpointing": {"scope": "mlp"}}),
    ("per-operator scope", {"activation_checkpointing": {"scope": "ops"}}),
    ("CPU offload", {"fsdp": {"cpu_offload": True}}),
    ("activation offload", {"activation_checkpointing": {"offload": True}}),
    ("q and v only", {"lora": {"target_modules": ["q_proj", "v_proj"]}}),
]


# the tiny Llama's linears ('all-linear' trains them all): the LoRA tensors each setup must give a gradient to
ALL_LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj")


def lora_keys(sections: dict, layers: int = 2) -> set[str]:
    """A and B of each linear the setup targets in every layer, as PEFT names them in the live model."""
    targets = sections.get("lora", {}).get("target_modules")
    modules = [m for m in ALL_LINEAR if targets is None or m.rsplit(".", 1)[1] in targets]
    return {f"base_model.model.model.layers.{i}.{m}.lora_{part}.default.weight" for i in range(layers)
            for m in modules for part in "AB"}


def lora_forward(fuse: bool) -> dict:
    """The lora section's keys for the fused forward (the defaults), or PEFT's own: unfused, the input cast up to
    the weights' dtype."""
    return {"fuse_projections": True} if fuse else {"fuse_projections": False, "compute_dtype": "weights"}


def merged(sections: dict, fuse: bool) -> dict:
    return {**sections, "lora": {**sections.get("lora", {}), **lora_forward(fuse)}}


def nonzero_b(model: torch.nn.Module, rank: int) -> None:
    """LoRA's B starts at zero, which would hide every A product from the loss: give it seeded values of a trained
    adapter's size (each rank its shard's, the same in both runs)."""
    generator = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(0.01 * torch.randn(local.shape, generator=generator))


def loss_and_grads(info, model_dir, sections, per_rank):
    cfg = tiny_config(model_dir, **sections)
    model = build_sharded_model(cfg, info)
    nonzero_b(model, info.rank)
    torch.manual_seed(info.rank)  # dropout's masks: the same draws in both runs
    result = accumulate_gradients(model, per_rank[info.rank], info.device, ForwardLoss(None))
    groups = {id(m.forward.args[1]) for m in model.modules() if hasattr(m.forward, "args")}
    return {"loss": result.loss, "grads": full_grads(model), "groups": len(groups)}


@pytest.fixture(scope="module")
def per_rank(tiny_model_dir):
    """Each rank's micro-batches: one padded, one of packed rows (samples of different lengths)."""
    samples = variable_length_samples(tiny_config(tiny_model_dir), 16)
    mine = [samples[:8], samples[8:]]
    return [[batches(s[:4], 4, PAD)[0], collate_packed([s[4:6], s[6:8]], PAD)] for s in mine]


@pytest.mark.slow  # gloo ranks
def test_fused_projections_give_peft_s_loss_and_gradients(tiny_model_dir, per_rank, tmp_path):
    calls = [(loss_and_grads, (tiny_model_dir, merged(sections, fuse), per_rank))
             for _, sections in SETUPS for fuse in (True, False)]
    results = run_ranks_sequence(calls, 2, tmp_path)
    # the fused (stacked) and unfused matmuls sum in different orders: per tensor, 1.5e-6 seen for rsLoRA's
    # smallest on an AMD EPYC, more on CPUs whose kernels block otherwise (AMX); a step's tokens the longest sum
    bound = fp32_reordering_bound(sum(batch.n_tokens for rank in per_rank for batch in rank))
    for index, (name, sections) in enumerate(SETUPS):
        fused, unfused = results[2 * index], results[2 * index + 1]
        assert fused["loss"] == pytest.approx(unfused["loss"], rel=bound), name
        assert fused["grads"].keys() == unfused["grads"].keys() >= lora_keys(sections), name
        assert relative_difference(fused["grads"], unfused["grads"]) <= bound, name
        assert unfused["groups"] == 0, name  # PEFT's own forward: the reference
    # 2 layers: q/k/v and gate/up a layer, and o and down on their own; q and v only: one group a layer
    assert results[0]["groups"] == 2 * 4 and results[-2]["groups"] == 2


def dtypes_and_grads(info, model_dir, compute_dtype, dora=False):
    cfg = tiny_config(model_dir, lora={"compute_dtype": compute_dtype, "use_dora": dora})
    cfg.model.dtype = cfg.quant.compute_dtype = "bfloat16"
    model = build_sharded_model(cfg, info)
    nonzero_b(model, info.rank)
    seen: set[torch.dtype] = set()
    hook = torch.nn.functional.linear

    def spy(x, weight, *args):
        if weight.shape[0] in (cfg.lora.r, 3 * cfg.lora.r, 2 * cfg.lora.r) or x.shape[-1] == cfg.lora.r:
            seen.add(x.dtype)
        return hook(x, weight, *args)

    samples = variable_length_samples(cfg, 4)
    torch.nn.functional.linear = spy
    try:
        loss = ForwardLoss(None)(model, batches(samples, 4, PAD)[0], info.device)
    finally:
        torch.nn.functional.linear = hook
    loss.backward()
    grads = full_grads(model)
    return {"seen": seen, "grad_dtypes": {g.dtype for g in grads.values()}, "grads": grads}


@pytest.mark.slow  # a bf16 model on the CPU: slow kernels, a tiny model
def test_lora_compute_in_the_base_dtype_keeps_fp32_gradients(tiny_model_dir, tmp_path):
    """`weights` (PEFT's): the LoRA matmuls see fp32 inputs; `base`: bf16 ones. The gradients and the weights
    stay fp32 either way, and the two runs' gradients agree to bf16's precision."""
    fp32, bf16, fp32_dora, bf16_dora = run_ranks_sequence(
        [(dtypes_and_grads, (tiny_model_dir, dtype, dora)) for dora in (False, True) for dtype in ("weights", "base")],
        1, tmp_path)
    assert fp32["seen"] == {torch.float32} and bf16["seen"] == {torch.bfloat16}
    for weights, base in ((fp32, bf16), (fp32_dora, bf16_dora)):  # DoRA: its A and B cast to the input's dtype
        assert weights["grad_dtypes"] == base["grad_dtypes"] == {torch.float32}
        assert 0 < relative_difference(base["grads"], weights["grads"]) <= 0.05


def test_a_group_projects_once_and_again_for_a_new_input():
    """One stacked matmul serves every member of a group for one input; a new input (the recompute of a
    checkpointed layer) or a member asking twice projects again; nothing is held once all have taken theirs."""

    class Member(torch.nn.Module):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(6, rank, bias=False)})

    members = [Member(2), Member(3)]
    group = SharedInput(members, compute_in_base_dtype=False)
    x = torch.randn(4, 6)
    first_cast, first = group.take(0, x, "default", torch.float32)
    assert group.input is x and set(group.outputs) == {1}
    cast, second = group.take(1, x, "default", torch.float32)
    assert cast is first_cast and group.input is None and group.cast is None and not group.outputs
    torch.testing.assert_close(first, members[0].lora_A["default"](x), rtol=0, atol=1e-6)
    torch.testing.assert_close(second, members[1].lora_A["default"](x), rtol=0, atol=1e-6)
    group.take(0, x, "default", torch.float32)
    again, _ = group.take(0, x.clone(), "default", torch.float32)  # a recompute: a new tensor of the same values
    assert again is not first_cast and set(group.outputs) == {1}
