"""What a loaded model really holds, counted from its tensors: the measured side of the planner's figures.

The planner (plan.memory) predicts bytes from shapes on the meta device; these count the real tensors, so
scripts/load_as_rank.py can report one rank's memory and the tests can hold the planner to it byte for byte.
"""

from __future__ import annotations

import bitsandbytes.functional as bnbf


def held_quant_state_bytes(state: bnbf.QuantState) -> int:
    """A Linear4bit's quantization state as stored: absmax (uint8 with double quantization) and the 4-bit
    codebook, plus, when nested, the second level's fp32 absmax, its codebook and the offset. The planner's
    counterpart, from shapes alone, is plan.memory.quant_state_bytes."""
    tensors = [state.absmax, state.code]
    if getattr(state, "state2", None) is not None:
        tensors += [state.state2.absmax, state.state2.code, state.offset]
    return sum(t.numel() * t.element_size() for t in tensors)
