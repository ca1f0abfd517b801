"""The torch releases the package runs on: each fix an older torch lacks, held to what the newer torch does.

Every test here passes on the torch that fixed the behaviour (natively) and on the older one (through the fix): CI
runs this file in both lanes (make test on 2.13, make test-old-torch on 2.11)."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils.flop_counter import flop_registry

from qlora_fsdp import torch_versions
from qlora_fsdp.distributed import cleanup, init_fake_distributed
from qlora_fsdp.errors import ModelLoadError
from qlora_fsdp.torch_versions import (
    fixes_needed,
    fsdp_param_groups,
    metadata_only_parameter_subclass,
    require_supported,
    with_query_heads,
)

aten = torch.ops.aten


# every patch held to the newer torch's behaviour in both lanes (make test-old-torch runs marked tests only)
pytestmark = pytest.mark.old_torch


def test_releases_below_2_11_are_refused_in_one_line():
    with pytest.raises(ModelLoadError, match=r"^torch 2\.10\.2\+cu128 is too old: .*pip install torch==2\.13\.0"):
        require_supported("2.10.2+cu128")
    for accepted in ("2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.0.dev20261101", "3.0.0"):
        require_supported(accepted)


def test_each_fix_applies_only_below_the_release_that_made_it():
    def needed(version: str) -> list[str]:
        return [fix.upstream for fix in fixes_needed(version)]

    fsdp, fake, flops = (fix.upstream for fix in torch_versions.FIXES)
    assert needed("2.11.0+cu130") == [fsdp, fake, flops]
    assert needed("2.12.1+cu130") == [fake]
    assert needed("2.13.0") == needed("2.14.1") == []
    assert all("pytorch" in fix.upstream for fix in torch_versions.FIXES)
    assert torch_versions.apply_fixes() == fixes_needed()  # importing the package applied what this torch lacks


class Packed(nn.Module):
    """A module shaped as ours: packed 4-bit bytes (frozen uint8) beside a trained float parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.packed = nn.Parameter(torch.arange(64, dtype=torch.uint8).reshape(16, 4), requires_grad=False)
        self.lora = nn.Parameter(torch.ones(8, 4))


def test_fsdp2_shards_uint8_beside_float_under_a_bf16_policy():
    """torch 2.11's FSDP2 made every shard require grad (uint8 cannot) and cast non-float shards to param_dtype;
    2.12 fixed both. A rank of two keeps its half of the bytes, frozen and uint8, and gathers them as bytes."""
    from qlora_fsdp.measure.fake_world import leave_fake_world

    leave_fake_world()  # a plan made earlier in this process keeps its fake world for the next plan: ended here
    init_fake_distributed(2, torch.device("cpu"))
    try:
        module = Packed()
        fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        packed, lora = module.packed, module.lora
        assert packed.dtype == torch.uint8 and not packed.requires_grad and lora.requires_grad
        assert torch.equal(packed.to_local(), torch.arange(32, dtype=torch.uint8).reshape(8, 4))
        state = module._get_fsdp_state()
        state._lazy_init()  # where FSDP2 settles each parameter's dtypes
        (group,) = fsdp_param_groups(state)
        dtypes = {fsdp_param._param_fqn: fsdp_param.param_dtype for fsdp_param in group.fsdp_params}
        assert dtypes == {"packed": None, "lora": torch.bfloat16}
        inputs = {fsdp_param._param_fqn: fsdp_param.all_gather_inputs[0].dtype for fsdp_param in group.fsdp_params}
        assert inputs == {"packed": torch.uint8, "lora": torch.bfloat16}
    finally:
        cleanup()
    assert not dist.is_initialized()


def legacy_subclass_check(value: object) -> bool:
    """torch 2.11/2.12's rule: any tensor type but Tensor, FakeTensor and Parameter itself is unrecognized."""
    return (not isinstance(value, fake_tensor.FakeTensor) and isinstance(value, torch.Tensor)
            and type(value) is not torch.Tensor and type(value) is not nn.Parameter)


class DispatchingParameter(nn.Parameter):
    """A Parameter subclass with a dispatch of its own: fake tensors must still give it its turn."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return NotImplemented


def test_fake_tensors_pass_metadata_only_parameter_subclasses():
    """The planner's meta model holds Params4bit; fake tensors in 2.11/2.12 refused any op on it (empty_like in
    to_empty). The rule is 2.13's: a Parameter subclass without a dispatch of its own passes; a wrapper does not."""
    weight = bnb.nn.Params4bit(torch.empty(8, 4, device="meta"), requires_grad=False)
    wrapper = nn.Parameter(TwoTensor(torch.zeros(2), torch.zeros(2)))
    samples = [torch.zeros(2), nn.Parameter(torch.zeros(2)), weight, wrapper, TwoTensor(torch.zeros(2), torch.zeros(2)),
               DispatchingParameter(torch.zeros(2))]
    expected = [False, False, False, True, True, True]
    assert [fake_tensor._check_for_subclass_arg(sample) for sample in samples] == expected
    assert [legacy_subclass_check(sample) for sample in samples] == [False, False, True, True, True, True]
    # the fix's own rule, whichever torch runs (on 2.13 the check above is torch's, not the fix's)
    assert [metadata_only_parameter_subclass(sample) for sample in samples] == [False, True, True, False, False, False]
    with FakeTensorMode(allow_non_fake_inputs=True):  # as the planner's fake step enters it
        copy = torch.empty_like(weight, device="cpu")
    assert isinstance(copy, fake_tensor.FakeTensor) and copy.shape == (8, 4)


def strict_sdpa_flops(query: tuple[int, ...], key: tuple[int, ...], value: tuple[int, ...]) -> int:
    """torch 2.11's forward formula: key and value must have the query's heads."""
    assert query[:2] == key[:2] == value[:2] and query[3] == key[3], "shapes are incompatible"
    batch, heads, queries, dim = query
    return 2 * batch * heads * queries * dim * key[2] + 2 * batch * heads * queries * key[2] * value[3]


def test_flop_counter_counts_grouped_query_sdpa():
    """8 query heads over 2 key/value heads: the work of 8 heads, as the kernel broadcasts (2.12's formula); the
    strict formula with the fix gives the same, and torch's formulas (fixed or native) as the planner calls them
    (measure/op_work.py) count the GPU's attention ops so, forward and backward."""
    query, key = (2, 8, 5, 16), (2, 2, 7, 16)
    work = 2 * (2 * 2 * 8 * 5 * 7 * 16)  # scores and output, each a matmul of 2*b*h*s_q*s_k*d
    with pytest.raises(AssertionError):
        strict_sdpa_flops(query, key, key)
    assert with_query_heads(strict_sdpa_flops)(query, key, key) == work
    with FakeTensorMode():
        q, k, v = (torch.empty(shape) for shape in (query, key, key))
        forward = flop_registry[aten._scaled_dot_product_efficient_attention](q, k, v, None, False, out_val=None)
        backward = flop_registry[aten._scaled_dot_product_efficient_attention_backward](
            torch.empty(query), q, k, v, out_val=None)
    assert forward == work and backward == 5 * work // 2  # the backward's five matmuls to the forward's two
