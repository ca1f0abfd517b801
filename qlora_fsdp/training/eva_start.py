"""EVA (Paischer et al. 2024, `lora.init: eva`): each LoRA layer's A starts as the top right-singular vectors of that
layer's inputs over the first micro-batches, B at zero, the base unchanged.

PEFT 0.21's own `get_eva_state_dict` computes them (incremental PCA, hooks on the LoRA layers, fed until every
layer's components stop moving: cosine similarity tau), here on the sharded 4-bit model with training's own
micro-batches and forward: every rank's layer inputs are gathered, so every rank fits the same components. Only the
tokens that are targets count (PEFT's label mask) and padding never does. rho is 1: every layer keeps rank r (a
redistribution across layers would need per-layer ranks, which the sharded adapter does not have yet).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, cast

import peft
import torch
import torch.distributed as dist
from peft.tuners.lora.eva import get_eva_state_dict
from torch import nn

from qlora_fsdp.data.batching import Batch
from qlora_fsdp.labels import IGNORE_INDEX
from qlora_fsdp.loading.names import clean_name
from qlora_fsdp.loading.placement import copy_full_into
from qlora_fsdp.losses.forward import model_inputs

EVA_POSITIONS = "eva_positions"  # the layer-input positions the SVD reads, beside the model's own inputs


def target_positions_mask(batch: Batch, shape: torch.Size) -> torch.Tensor:
    """True at each token that is a target (the unshifted labels PEFT masks with), in the layer inputs' shape."""
    targets = (batch.labels != IGNORE_INDEX).reshape(shape)  # shifted: position t says token t + 1 is a target
    mask = torch.zeros_like(targets)
    mask[..., 1:] = targets[..., :-1]
    return mask


class EvaBatches:
    """Training's first micro-batches as PEFT's EVA reads them (re-iterable: it cycles until it converges); the
    sampler is left where it was."""

    def __init__(self, model: nn.Module, micro_batches: Any, sampler: Any, device: torch.device) -> None:
        self.model, self.micro_batches, self.sampler, self.device = model, micro_batches, sampler, device
        self.start = copy.deepcopy(sampler.state_dict())

    def steps(self) -> int:
        """An epoch's steps: the most EVA reads before it starts again (PEFT cycles until it converges)."""
        return math.ceil(self.sampler.n_units / self.sampler.units_per_step)

    def __len__(self) -> int:  # PEFT asks for it (refusing an empty loader)
        return self.steps() * self.sampler.grad_accum_steps

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.sampler.load_state_dict(copy.deepcopy(self.start))
        try:
            for _ in range(self.steps()):
                for batch in self.micro_batches():
                    yield eva_inputs(self.model, batch, self.device)
        finally:
            self.sampler.load_state_dict(copy.deepcopy(self.start))


def eva_inputs(model: nn.Module, batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    """A micro-batch as EVA's loader item: the model's inputs (as training lays them out) and the positions read."""
    inputs, _, _ = model_inputs(model, batch, device)
    inputs = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    mask = target_positions_mask(batch, inputs["input_ids"].shape).to(device)
    return {**inputs, EVA_POSITIONS: mask.nonzero()}


def forward(model: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
    return model(**{k: v for k, v in inputs.items() if k != EVA_POSITIONS}, use_cache=False)


def eva_start(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> int:
    """Fill every LoRA layer's A from the batches' layer inputs (B stays zero); the layers filled. `batches`: a
    re-iterable of eva_inputs' items (EvaBatches: training's first micro-batches)."""
    lora = cast(peft.LoraConfig, copy.deepcopy(cast(Any, model).peft_config["default"]))
    lora.init_lora_weights, lora.eva_config = "eva", peft.EvaConfig(rho=1.0)
    with torch.no_grad(), warnings.catch_warnings():
        # PEFT warns that ranks must see different inputs when it gathers them: they do (each its own micro-batches)
        warnings.filterwarnings("ignore", message=".*gather_distributed_inputs.*")
        components = get_eva_state_dict(model, batches, lora, forward_fn=forward,
                                        prepare_model_inputs_fn=lambda inputs, _config: inputs[EVA_POSITIONS],
                                        gather_distributed_inputs=dist.is_initialized(), show_progress_bar=False)
        by_name = {clean_name(name): value for name, value in components.items()}
        filled = 0
        for name, module in model.named_modules():
            start = by_name.get(clean_name(name))
            if start is not None:
                weight = cast(Any, module).lora_A["default"].weight
                copy_full_into(weight, start.to(device=weight.device, dtype=weight.dtype))
                filled += 1
    return filled
