"""The torch releases the package runs on (2.11 to 2.13: what GPU machines ship) and what an older one lacks.

requirements.txt pins the tested 2.13.0; GPU images and clusters often come with 2.11 or 2.12 and no package index,
so the package runs on them too. Each fix below was made upstream in a later release: it is applied, once, only
on a torch older than that release, and names the upstream issue. Importing this module checks the release (below
2.11: one line) and applies what the running torch needs; the modules that shard or plan import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qlora_fsdp.errors import ModelLoadError

OLDEST = (2, 11)


def release(version: str) -> tuple[int, int]:
    """'2.11.0+cu130' -> (2, 11)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def require_supported(version: str = torch.__version__) -> None:
    """Below 2.11 nothing here was read or tried (FSDP2 and fake tensors changed a lot before it): one line, not a
    traceback deep in a sharded step. A release newer than tested is let through (each fix here applies below)."""
    if release(version) < OLDEST:
        raise ModelLoadError(f"torch {version} is too old: qlora-fsdp runs on torch 2.11 to 2.13 "
                             "(pip install torch==2.13.0, as requirements.txt pins)")


# ---- FSDP2 and non-float parameters (the packed 4-bit weights are uint8) --------------------------------------

def _float_only_grad_parameter(data: torch.Tensor, requires_grad: bool = True) -> nn.Parameter:
    """nn.Parameter, but non-float data never requires grad (autograd refuses it: "only Tensors of floating point
    dtype can require gradients")."""
    return nn.Parameter(data, requires_grad=requires_grad and (data.is_floating_point() or data.is_complex()))


class _NnForFsdpParam:
    """What torch 2.11's `_fsdp_param` module sees as `nn`: torch.nn with the Parameter above. It builds each shard
    as `nn.Parameter(dtensor)` (requiring grad) and only then copies the original's flag, which uint8 refuses."""

    Parameter = staticmethod(_float_only_grad_parameter)

    def __getattr__(self, name: str) -> Any:
        return getattr(nn, name)


def _fsdp2_non_float_parameters() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    _fsdp_param.nn = _NnForFsdpParam()  # type: ignore[assignment]
    init_dtype_attrs = _fsdp_param.FSDPParam.init_dtype_attrs

    def no_param_dtype_for_non_float(self: Any, mp_policy: Any) -> None:
        # torch 2.11 would cast the uint8 shards to `param_dtype` (fsdp.param_dtype: bfloat16) before gathering
        init_dtype_attrs(self, mp_policy)
        if not self.orig_dtype.is_floating_point:
            self.param_dtype = None

    _fsdp_param.FSDPParam.init_dtype_attrs = no_param_dtype_for_non_float  # type: ignore[method-assign]


# ---- fake tensors and Parameter subclasses (the planner's meta model holds bitsandbytes' Params4bit) ------------

def metadata_only_parameter_subclass(value: object) -> bool:
    """A Parameter subclass that keeps Tensor's disabled __torch_dispatch__ (Params4bit): fake tensors may treat it
    as a plain Parameter. One with a dispatch of its own (a wrapper subclass) must still get its turn."""
    kind = type(value)
    return issubclass(kind, nn.Parameter) and kind.__torch_dispatch__ is torch.Tensor.__torch_dispatch__


def _fake_tensor_parameter_subclasses() -> None:
    from torch._subclasses import fake_tensor

    unrecognized = fake_tensor._check_for_subclass_arg

    def check_for_subclass_arg(x: object) -> bool:  # torch's own argument name
        return not metadata_only_parameter_subclass(x) and unrecognized(x)

    # torch 2.11/2.12 return NotImplemented for any op given such a parameter ("Multiple dispatch failed for
    # aten.empty_like": the planner's to_empty)
    fake_tensor._check_for_subclass_arg = check_for_subclass_arg


# ---- the flop counter and grouped-query attention --------------------------------------------------------------

def with_query_heads(count: Callable[..., int]) -> Callable[..., int]:
    """An sdpa flop formula that requires key and value to have the query's heads, made to accept fewer (grouped
    query): the kernel broadcasts them, so the work is that of the query's heads."""

    def grouped(*shapes: tuple[int, ...]) -> int:
        *leading, query, key, value = shapes  # the backward's formula has grad_out first
        heads = query[1]
        return count(*leading, query, (key[0], heads, *key[2:]), (value[0], heads, *value[2:]))

    return grouped


def _flop_counter_grouped_query() -> None:
    from torch.utils import flop_counter

    # the registered formulas look both up by name when called
    flop_counter.sdpa_flop_count = with_query_heads(flop_counter.sdpa_flop_count)
    flop_counter.sdpa_backward_flop_count = with_query_heads(flop_counter.sdpa_backward_flop_count)


# ---- the table ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fix:
    """A behaviour the package needs that torch gained in `fixed_in`; `apply` patches it into an older torch."""

    what: str
    fixed_in: tuple[int, int]
    upstream: str
    apply: Callable[[], None]


FIXES = (
    Fix("FSDP2 shards non-float parameters: never made to require grad, never cast to param_dtype", (2, 12),
        "pytorch #177844 (PRs #177948, #178075)", _fsdp2_non_float_parameters),
    Fix("fake tensors pass metadata-only Parameter subclasses (bitsandbytes' Params4bit)", (2, 13),
        "pytorch #174274 (PR #184871)", _fake_tensor_parameter_subclasses),
    Fix("the flop counter counts grouped-query sdpa", (2, 12), "pytorch PR #177169", _flop_counter_grouped_query),
)


def fixes_needed(version: str = torch.__version__) -> list[Fix]:
    return [fix for fix in FIXES if release(version) < fix.fixed_in]


_applied: list[Fix] = []


def apply_fixes() -> list[Fix]:
    """Patch, once a process, what the running torch lacks; returns what was patched."""
    require_supported()
    if not _applied:
        for fix in fixes_needed():
            fix.apply()
            _applied.append(fix)
    return list(_applied)


# ---- names that differ ---------------------------------------------------------------------------------------------

def fsdp_param_groups(state: Any) -> list[Any]:
    """An FSDP2 module state's parameter groups: a list since torch 2.12, one optional group in 2.11."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [group] if group is not None else []


apply_fixes()
