"""Which in-process tests reach the torch code that differs between releases, so the torch 2.11 lane runs those.

`make test-old-torch` runs the tests marked `old_torch` only. What differs between 2.11 and 2.13 is FSDP2 (its
parameters, dtypes and groups), fake tensors, the flop counter, DTensor, flex attention and the compiler
(qlora_fsdp/torch_versions.py, DESIGN fact 28); each has a class every use goes through. `watch()` wraps their
constructors (or calls) to note that one ran; conftest resets the note before each test and, after an in-process
test that reached one without the mark, records it: the session then fails naming it. So a test cannot leave the
second lane by a missing mark. Tests on pool ranks or in subprocesses are slow ones and chosen for the lane by hand
(tests/README.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_REACHED: set[str] = set()


def _noting(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def noted(*args: Any, **kwargs: Any) -> Any:
        _REACHED.add(name)
        return method(*args, **kwargs)

    return noted


def _version_specific() -> list[tuple[str, Any, str]]:
    """(what, the class, the method every use calls)."""
    import torch._dynamo.eval_frame as eval_frame
    from torch._higher_order_ops.flex_attention import FlexAttentionHOP
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.tensor import DTensor
    from torch.utils.flop_counter import FlopCounterMode

    return [("FSDP2", FSDPParam, "__init__"), ("fake tensors", FakeTensorMode, "__init__"),
            ("the flop counter", FlopCounterMode, "__init__"), ("DTensor", DTensor, "__new__"),
            ("flex attention", FlexAttentionHOP, "__call__"),
            ("torch.compile", eval_frame.OptimizeContext, "__init__")]


def watch() -> None:
    for name, owner, method in _version_specific():
        original = owner.__dict__[method]
        if isinstance(original, staticmethod):
            setattr(owner, method, staticmethod(_noting(name, original.__func__)))
        else:
            setattr(owner, method, _noting(name, original))


def reset() -> None:
    _REACHED.clear()


def reached() -> set[str]:
    return set(_REACHED)
