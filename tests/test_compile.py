"""`train.compile`: compiled decoder layers give the uncompiled loss and gradients, sharded on 2 ranks with
checkpointing and per-sample attention of packed rows (the path a packed recipe takes), fused LoRA projections
against PEFT's own."""

from __future__ import annotations

import pytest
import torch

from qlora_fsdp.data.batching import collate_packed
from qlora_fsdp.layers.attention import REGISTERED_NAME
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.losses.forward import ForwardLoss
from tests.helpers import full_grads, relative_difference, run_ranks, tiny_config, variable_length_samples
from tests.test_fused_lora import lora_forward, nonzero_b

pytestmark = pytest.mark.slow


def loss_and_grads(info, model_dir, compile_layers: bool, fuse: bool = True):
    cfg = tiny_config(model_dir, data={"packing": True}, train={"compile": compile_layers},
                      lora=lora_forward(fuse))
    torch.manual_seed(0)
    model = build_sharded_model(cfg, info)
    nonzero_b(model, info.rank)  # so that the A products reach the loss
    samples = variable_length_samples(cfg, 8)
    mine = samples[info.rank * 4 : info.rank * 4 + 4]
    batch = collate_packed([mine[:3], mine[3:]], pad_id=0)
    results = []
    for _ in range(2):  # the second call runs the compiled graphs cached by the first
        model.zero_grad()
        loss = ForwardLoss.for_config(cfg, info.device)(model, batch, info.device)
        loss.backward()
        results.append((loss.detach(), full_grads(model)))
    return results, model.config._attn_implementation


def compiled_and_eager(info, model_dir):
    return (loss_and_grads(info, model_dir, False), loss_and_grads(info, model_dir, True),
            loss_and_grads(info, model_dir, False, fuse=False))


def test_compiled_layers_give_the_same_loss_and_gradients(tiny_model_dir, tmp_path):
    """Compiled layers with fused LoRA projections (the default) against eager ones, fused and PEFT's own."""
    for (eager, kernel), (compiled, _), (unfused, _) in run_ranks(compiled_and_eager, 2, tiny_model_dir,
                                                                  tmp_dir=tmp_path):
        assert kernel == REGISTERED_NAME  # our per-sample kernel (sdpa_varlen) as transformers knows it
        for reference in (eager, unfused):
            for (eager_loss, eager_grads), (compiled_loss, compiled_grads) in zip(reference, compiled, strict=True):
                torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-5)
                assert relative_difference(compiled_grads, eager_grads) < 1e-5
