"""Every optimizer a recipe can name, in one registry: its class, its fallback on host tensors and its state size.

Training builds from it, the config validates `optim.name` against it and the planner sizes the state with it, so
adding an optimizer is one entry here (plus its test). Pure Python: classes are imported when an optimizer is built.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps 32-bit state for tensors smaller than this
BNB_STATE_BLOCK = 256  # block size of bitsandbytes' 8-bit optimizer state


def adam_state_bytes(n_elements: int, itemsize: int) -> int:
    """torch AdamW: exp_avg and exp_avg_sq in the parameter's dtype, and a fp32 step counter."""
    return 2 * itemsize * n_elements + 4


def bnb_8bit_state_bytes(n_elements: int, itemsize: int) -> int:
    """bitsandbytes' 8-bit Adam: two uint8 states, their block-wise absmax and two 8-bit codes; 32-bit state for
    small tensors."""
    if n_elements < BNB_MIN_8BIT_SIZE:
        return 2 * 4 * n_elements
    blocks = math.ceil(n_elements / BNB_STATE_BLOCK)
    return 2 * n_elements + 2 * 4 * blocks + 2 * 256 * 4


def bnb_32bit_state_bytes(n_elements: int, itemsize: int) -> int:
    """bitsandbytes' Adam on a tensor overridden to 32-bit state (trained embeddings): two fp32 states."""
    return 2 * 4 * n_elements


@dataclass(frozen=True)
class OptimizerSpec:
    class_path: str  # module.Class, imported when the optimizer is built
    state_bytes: Callable[[int, int], int]  # (elements of a local shard, their itemsize) -> bytes of state
    on_host: str | None = None  # the registry name to use when every shard is in host memory
    # the state of a tensor kept at full precision (training.optimizer's full_state groups); None: state_bytes
    full_state_bytes: Callable[[int, int], int] | None = None

    def state_bytes_of(self, n_elements: int, itemsize: int, full_state: bool) -> int:
        rule = self.full_state_bytes if full_state and self.full_state_bytes else self.state_bytes
        return rule(n_elements, itemsize)

    def load_class(self) -> type:
        module, _, name = self.class_path.rpartition(".")
        return getattr(importlib.import_module(module), name)


OPTIMIZERS: dict[str, OptimizerSpec] = {
    # host shards (FSDP2's CPU offload, a CPU run) have nothing to page: bitsandbytes would fall back with a warning
    "paged_adamw_8bit": OptimizerSpec("bitsandbytes.optim.PagedAdamW8bit", bnb_8bit_state_bytes, on_host="adamw_8bit",
                                      full_state_bytes=bnb_32bit_state_bytes),
    "adamw_8bit": OptimizerSpec("bitsandbytes.optim.AdamW8bit", bnb_8bit_state_bytes,
                                full_state_bytes=bnb_32bit_state_bytes),
    "adamw": OptimizerSpec("torch.optim.AdamW", adam_state_bytes),
}
