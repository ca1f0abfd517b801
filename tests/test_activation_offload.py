"""Activation offload: what checkpointing keeps goes to host memory and comes back bit for bit in backward."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.checkpoint import checkpoint

from qlora_fsdp.layers.activation_offload import ActivationOffloader
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.losses.forward import loss_sum
from tests.helpers import batches, full_grads, run_ranks_sequence, tiny_config, variable_length_samples

CPU = torch.device("cpu")
PAD = 2
WIDTH, ROWS, BLOCKS = 16, 8, 4


# ---- in-process: small checkpointed blocks ------------------------------------------------------------

class Block(nn.Module):
    """A residual MLP block; `table` stands for a tensor every layer is handed (a rotary cos/sin table)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        x = x * table if table is not None else x
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block() for _ in range(BLOCKS))


def loss_and_grads(model: nn.ModuleList, x: torch.Tensor, offloader: ActivationOffloader | None,
                   table: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward through checkpointed blocks and a loss that saves nothing (sum), under the offloader or not."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with offloader.offloading() if offloader else contextlib.nullcontext():
        h = x * 2  # an intermediate: the first block's input has a grad_fn, like a layer's hidden states
        for block in model:
            h = checkpoint(block, h, *([table] if table is not None else []), use_reentrant=False)
        loss = h.sum()
    loss.backward()
    assert x.grad is not None
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None] + [x.grad]


def test_checkpoint_inputs_offloaded_and_restored_exactly():
    """Loss and every gradient are bit-identical; exactly the checkpointed blocks' inputs went to host memory
    (the regions' insides go through checkpoint's own hooks) and all came back, each copied back ahead of its
    request but the first; their host copies are freed with the graph."""
    model, x = blocks(), torch.randn(ROWS, WIDTH)
    reference = loss_and_grads(model, x, None)
    offloader = ActivationOffloader(CPU, min_bytes=0)
    loss, grads = loss_and_grads(model, x, offloader)
    assert torch.equal(loss, reference[0])
    assert len(grads) == len(reference[1]) and all(map(torch.equal, grads, reference[1]))
    hidden_bytes = ROWS * WIDTH * 4
    stats = offloader.stats
    assert (stats.offloaded, stats.offloaded_bytes, stats.restored) == (BLOCKS, BLOCKS * hidden_bytes, BLOCKS)
    assert stats.prefetched == BLOCKS - 1
    assert stats.peak_host_bytes == BLOCKS * hidden_bytes and stats.host_bytes == 0


def test_tensor_handed_to_every_block_is_offloaded_once():
    model, x, table = blocks(), torch.randn(ROWS, WIDTH), torch.rand(ROWS, WIDTH) + 0.5
    reference = loss_and_grads(model, x, None, table)
    offloader = ActivationOffloader(CPU, min_bytes=0)
    loss, grads = loss_and_grads(model, x, offloader, table)
    assert torch.equal(loss, reference[0]) and all(map(torch.equal, grads, reference[1]))
    stats = offloader.stats
    assert (stats.offloaded, stats.deduplicated, stats.restored) == (BLOCKS + 1, BLOCKS - 1, BLOCKS + 1)


class KeepForBackward(torch.autograd.Function):
    """Saves the given tensors and hands what backward unpacks to the test."""

    unpacked: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor, *kept: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*kept)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        KeepForBackward.unpacked = list(ctx.saved_tensors)
        return (grad, *[None] * len(ctx.saved_tensors))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def test_views_round_trip_bit_for_bit():
    """Transposes keep their strides, slices come back as contiguous tensors of the same values, bf16 NaN
    payloads survive; a parameter and its transpose (the model holds them), a broadcast view and a tensor under
    min_bytes stay as they are."""
    base = torch.randn(64, 32)
    payloads = torch.tensor([0x7FC1, 0xFFAB, 0x7F80, 0x0001] * 64, dtype=torch.int32)  # NaNs, -NaN, inf, subnormal
    nan_payloads = payloads.to(torch.int16).view(torch.bfloat16)
    offloaded = [base.t(), base[8:40, 1:17], base[:, ::2], base.view(8, 8, 32).permute(2, 0, 1), nan_payloads]
    parameter, broadcast, small = nn.Parameter(torch.randn(64, 32)), torch.randn(64, 1).expand(64, 512), torch.ones(3)
    x = torch.randn(4, requires_grad=True)
    offloader = ActivationOffloader(CPU, min_bytes=64)
    with offloader.offloading():
        y = KeepForBackward.apply(x, *offloaded, parameter, parameter.t(), broadcast, small)
    assert offloader.stats.offloaded == len(offloaded)
    assert offloader.stats.offloaded_bytes == sum(t.numel() * t.element_size() for t in offloaded)
    y.sum().backward()
    restored = KeepForBackward.unpacked
    assert offloader.stats.restored == len(offloaded)
    for original, back in zip(offloaded, restored, strict=False):
        assert (back.shape, back.dtype, back.device) == (original.shape, original.dtype, original.device)
        assert torch.equal(bits(back), bits(original))
        assert back.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()  # a real round trip
    assert restored[0].stride() == base.t().stride() and restored[3].stride() == offloaded[3].stride()
    assert restored[1].is_contiguous() and restored[2].is_contiguous()
    assert restored[-4].data_ptr() == restored[-3].data_ptr() == parameter.data_ptr()
    assert restored[-2].untyped_storage().data_ptr() == broadcast.untyped_storage().data_ptr()
    assert restored[-1].untyped_storage().data_ptr() == small.untyped_storage().data_ptr()


def test_one_tensor_saved_twice_is_copied_once():
    table, a, b = torch.randn(32, 32), torch.randn(32, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)
    offloader = ActivationOffloader(CPU, min_bytes=0)
    with offloader.offloading():
        loss = (a * table).sum() + (b * table).sum()  # each mul saves `table` (and not the other factor's grad)
    stats = offloader.stats
    assert (stats.offloaded, stats.deduplicated, stats.offloaded_bytes) == (1, 1, table.numel() * 4)
    loss.backward()
    assert a.grad is not None and b.grad is not None
    assert torch.equal(a.grad, table) and torch.equal(b.grad, table)
    assert stats.restored == 1


def test_in_place_change_is_not_taken_for_the_same_tensor():
    """A tensor changed in place after it was saved is a different tensor to dedupe (its version moved)."""
    table, a = torch.randn(32, 32), torch.randn(32, 32, requires_grad=True)
    offloader = ActivationOffloader(CPU, min_bytes=0)
    with offloader.offloading():
        first = (a * table).sum()
        table.mul_(2)
        second = (a * table).sum()
    assert (offloader.stats.offloaded, offloader.stats.deduplicated) == (2, 0)
    (first + second).backward()
    assert a.grad is not None and torch.equal(a.grad, table / 2 + table)


def test_reset_starts_new_counters():
    model, x = blocks(), torch.randn(ROWS, WIDTH)
    offloader = ActivationOffloader(CPU, min_bytes=0)
    loss_and_grads(model, x, offloader)
    offloader.reset()
    assert offloader.stats == type(offloader.stats)()
    loss_and_grads(model, x, offloader)
    assert offloader.stats.offloaded == BLOCKS and offloader.stats.restored == BLOCKS


@pytest.mark.old_torch  # reaches torch code that differs between releases (tests/version_paths.py)
@pytest.mark.parametrize("host", ["cpu", "meta"])
def test_runs_under_fake_tensor_mode(host):
    """A memory planner measures a step with fake tensors: the hooks run there too, with `meta` standing in
    for host memory if asked."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        model, x = blocks(), torch.randn(ROWS, WIDTH)
        offloader = ActivationOffloader(CPU, min_bytes=0, host_device=host)
        loss, grads = loss_and_grads(model, x, offloader)
    assert isinstance(grads[0], FakeTensor) and grads[0].shape == model[0].up.weight.shape
    assert offloader.stats.offloaded == offloader.stats.restored == BLOCKS
    assert offloader.stats.peak_host_bytes == BLOCKS * ROWS * WIDTH * 4


# ---- the tiny model, sharded as training shards it -----------------------------------------------------

def offloaded_step(info, cfg, micro_batches_per_rank, offload):
    """One micro-batch's forward, loss and backward, the forward under the offloader or not."""
    model = build_sharded_model(cfg, info)
    offloader = ActivationOffloader(info.device, min_bytes=0)
    batch = micro_batches_per_rank[info.rank][0]
    with offloader.offloading() if offload else contextlib.nullcontext():
        loss = loss_sum(model, batch, info.device)
    loss.backward()
    hidden_bytes = batch.input_ids.numel() * model.config.hidden_size * 4  # fp32 compute
    return {"loss": loss.detach(), "grads": full_grads(model), "stats": dataclasses.asdict(offloader.stats),
            "checkpointed": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
            "hidden_bytes": hidden_bytes}


@pytest.fixture(scope="module")
def per_rank(tiny_model_dir):
    samples = variable_length_samples(tiny_config(tiny_model_dir), 8)
    return [batches(samples[:4], 4, PAD), batches(samples[4:8], 4, PAD)]


def assert_offload_changes_nothing(plain, offloaded):
    assert torch.equal(offloaded["loss"], plain["loss"])
    assert offloaded["grads"].keys() == plain["grads"].keys() and plain["grads"]
    assert all(torch.equal(offloaded["grads"][k], plain["grads"][k]) for k in plain["grads"])
    stats, layers = offloaded["stats"], offloaded["checkpointed"]
    assert layers == 2
    # each layer's input hidden states, and what the final norm, head and loss keep: all back, all freed
    assert stats["offloaded"] > layers and stats["offloaded_bytes"] > layers * offloaded["hidden_bytes"]
    assert stats["restored"] == stats["offloaded"] and stats["host_bytes"] == 0


@pytest.mark.slow
def test_tiny_model_one_rank(tiny_model_dir, per_rank, tmp_path):
    cfg = tiny_config(tiny_model_dir, activation_checkpointing={"mode": "every_layer"})
    plain, offloaded = run_ranks_sequence([(offloaded_step, (cfg, [per_rank[0]], off)) for off in (False, True)],
                                          1, tmp_path)
    assert_offload_changes_nothing(plain, offloaded)


@pytest.mark.old_torch  # run on torch 2.11 too (make test-old-torch)
@pytest.mark.slow
def test_tiny_model_two_ranks_with_and_without_parameter_offload(tiny_model_dir, per_rank, tmp_path):
    """FSDP2 over 2 gloo ranks, and with its parameter CPU offload as well: gradients reduce the same way with
    or without activation offload, so the numbers are identical, not merely close."""
    configs = [tiny_config(tiny_model_dir, activation_checkpointing={"mode": "every_layer"},
                           fsdp={"cpu_offload": cpu_offload}) for cpu_offload in (False, True)]
    calls = [(offloaded_step, (cfg, per_rank, off)) for cfg in configs for off in (False, True)]
    for rank in run_ranks_sequence(calls, 2, tmp_path, all_ranks=True):
        assert_offload_changes_nothing(rank[0], rank[1])
        assert_offload_changes_nothing(rank[2], rank[3])
