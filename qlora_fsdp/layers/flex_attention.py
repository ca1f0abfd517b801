"""Flex attention as a run uses it: short grouped-query rows compile, and a compile that fails falls back.

transformers' flex attention compiles torch's `flex_attention` once a process. For queries under 128 tokens (every
decoding step; a short row) inductor picks its flex-decoding kernel on CUDA, whose block-size check finds no valid
choice for grouped-query rows (`NoValidChoicesError`, seen on an H200 with torch 2.11; the same check in 2.12 and
2.13, pytorch PR #185349). `FORCE_USE_FLEX_ATTENTION` makes inductor use its main flex kernel there, which compiles.

Any other failure to compile (no C++ compiler, another lowering error) must not end a run hours in: the call falls
back, for the rest of the process, to torch's uncompiled flex attention (the same block mask and score function,
exact, but holding each call's scores whole), said once in one line. The backward compiles when it first runs, in
the loss's backward; the first call that will need one runs a trial forward and backward first, inside the guard,
unless it runs inside a checkpointed layer (then a backward that fails to compile still ends the run).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations import flex_attention as transformers_flex
from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask

from qlora_fsdp.errors import first_line

# the name transformers runs it by: containing "flex_attention", so transformers' own checks of a family's flex
# support apply, and built with flex's block masks
REGISTERED_FLEX = "flex_attention_guarded"
DECODING_KERNEL_QUERIES = 128  # inductor's flex-decoding kernel takes queries shorter than this


class _State:
    fallback_reason: str | None = None  # set once compiling failed in this process
    backward_tried = False  # a backward compiled (and ran) once in this process


def kernel_options(query: torch.Tensor, given: dict[str, Any] | None) -> dict[str, Any]:
    """The options a call compiles with: the main flex kernel for short queries, unless the caller chose."""
    options = dict(given or {})
    if query.shape[2] < DECODING_KERNEL_QUERIES and "BACKEND" not in options:  # BACKEND excludes the legacy knob
        options.setdefault("FORCE_USE_FLEX_ATTENTION", True)
    return options


@contextmanager
def uncompiled_flex() -> Iterator[None]:
    """transformers calls the uncompiled flex_attention when it thinks it is inside a compiled graph already."""
    seen = transformers_flex.is_torchdynamo_compiling
    transformers_flex.is_torchdynamo_compiling = lambda: True
    try:
        yield
    finally:
        transformers_flex.is_torchdynamo_compiling = seen


def needs_trial_backward(query: torch.Tensor) -> bool:
    """The first call that will need a backward, outside saved-tensor hooks: inside a checkpointed layer the trial's
    own saved tensors would go through checkpoint's hooks, whose unpacking recomputes the layer."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return query.requires_grad and torch.is_grad_enabled() and not _State.backward_tried and hooks is None


def trial_backward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, kwargs: dict[str, Any]) -> None:
    """Compiled attention compiles its backward when the backward first runs, far from here: a failure there would
    end the run. So the first call that will need one runs forward and backward on detached copies first."""
    copies = [tensor.detach().requires_grad_() for tensor in (query, key, value)]
    out, _ = transformers_flex.flex_attention_forward(module, copies[0], copies[1], copies[2], attention_mask,
                                                      **kwargs)
    out.float().sum().backward()
    _State.backward_tried = True


def guarded_flex_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' flex attention forward with the options above, and the fallback if compiling fails."""
    kwargs["kernel_options"] = kernel_options(query, kwargs.get("kernel_options"))
    if _State.fallback_reason is None:
        try:
            if needs_trial_backward(query):
                trial_backward(module, query, key, value, attention_mask, kwargs)
            return transformers_flex.flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:  # the compiler's failures, not the kernel's
            _State.fallback_reason = first_line(err)
            print(f"warning: flex attention did not compile ({_State.fallback_reason[:200]}); this process now "
                  "runs torch's uncompiled flex attention (exact, slower, scores held whole)", file=sys.stderr,
                  flush=True)
    with uncompiled_flex():
        return transformers_flex.flex_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(REGISTERED_FLEX, guarded_flex_forward)
AttentionMaskInterface.register(REGISTERED_FLEX, flex_attention_mask)
