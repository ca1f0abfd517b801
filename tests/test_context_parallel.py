"""Context parallel (fsdp.context_parallel): a row split over two ranks equals the same row on one rank, loss and
every LoRA gradient, packed (samples crossing the split) and padded, with accumulation; for Llama, Qwen3 and
gpt-oss (sliding windows, attention sinks and a mixture of experts in one family); with activation offload and the
MLP in tiles (gpt-oss: its experts) beside the split, as the long recipes run, against the whole row without; and
gpt-oss with the load-balancing loss (its router statistics summed over the split)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from qlora_fsdp.data.batching import collate, collate_packed
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.objectives.row_shards import one_row_per_sample, shard_row
from qlora_fsdp.objectives.supervised import accumulate_gradients
from qlora_fsdp.tools.tiny_model import train_tokenizer
from tests.families import write_family_model
from tests.helpers import (
    REPO,
    build_tiny_checkpoint,
    full_grads,
    relative_difference,
    run_ranks_sequence,
    tiny_config,
    variable_length_samples,
)

PAD = 2
FAMILIES = ("llama", "qwen3", "gpt_oss")


def whole_batches(samples, packed):
    """Two micro-batches (accumulation): packed rows of three samples, or a sample a row, padded."""
    halves = [samples[:6], samples[6:12]]
    if packed:
        return [collate_packed([half[i:i + 3] for i in range(0, 6, 3)], PAD) for half in halves]
    return [collate(half, PAD) for half in halves]


def split_batches(samples, packed, index):
    """The same micro-batches as this rank's part of them."""
    if packed:
        return [shard_row(batch, 2, index, PAD) for batch in whole_batches(samples, packed)]
    return [shard_row(one_row_per_sample(half, PAD), 2, index, PAD) for half in (samples[:6], samples[6:12])]


def loss_and_grads(info, cfg, samples, packed):
    model = build_sharded_model(cfg, info)
    batches = whole_batches(samples, packed) if info.world_size == 1 else split_batches(samples, packed, info.rank)
    result = accumulate_gradients(model, batches, info.device, ForwardLoss.for_config(cfg, info.device))
    return {"loss": result.loss, "targets": result.n_targets, "tokens": result.n_tokens, "grads": full_grads(model),
            "aux": result.metrics.get("router_aux_loss")}


@pytest.mark.old_torch  # run on torch 2.11 too (make test-old-torch)
@pytest.mark.slow  # gloo ranks
def test_a_row_split_over_two_ranks_equals_it_whole(tmp_path):
    setups, calls = [], {1: [], 2: []}
    tokenizer = train_tokenizer(REPO / "data" / "tiny_instruct.jsonl", 512)
    for family in FAMILIES:
        model_dir = (build_tiny_checkpoint(tmp_path / family, family=family) if family != "gpt_oss"
                     else write_family_model(tmp_path / family, family, tokenizer))
        cfg = tiny_config(model_dir)
        samples = variable_length_samples(cfg, 12)
        for packed in (True, False):
            setups.append((family, packed, "every layer checkpointed"))
            for world_size in (1, 2):
                split_cfg = tiny_config(model_dir, fsdp={"context_parallel": world_size})
                calls[world_size].append((loss_and_grads, (split_cfg, samples, packed)))
        if family != "qwen3":  # the long recipes' levers beside the split (offloaded layer inputs, the MLP or the
            # experts and the attention side in 7-token tiles) against the whole row without them
            setups.append((family, True, "offloaded, MLP and attention side in 7-token tiles"))
            levers = {"offload": True, "mlp_tile_tokens": 7, "attention_tile_tokens": 7}
            calls[1].append((loss_and_grads, (tiny_config(model_dir), samples, True)))
            calls[2].append((loss_and_grads, (tiny_config(model_dir, fsdp={"context_parallel": 2},
                                                          activation_checkpointing=levers), samples, True)))
    # gpt-oss whose config asks for the load-balancing loss: the router statistics summed over the split
    router_dir = write_family_model(tmp_path / "gpt_oss_router", "gpt_oss", tokenizer)
    config = AutoConfig.from_pretrained(router_dir)
    config.output_router_logits, config.router_aux_loss_coef = True, 0.3
    config.save_pretrained(router_dir)
    samples = variable_length_samples(tiny_config(router_dir), 12)
    for packed in (True, False):
        setups.append(("gpt_oss", packed, "the load-balancing loss"))
        for world_size in (1, 2):
            calls[world_size].append((loss_and_grads, (tiny_config(router_dir, fsdp={"context_parallel": world_size}),
                                                       samples, packed)))
    whole = run_ranks_sequence(calls[1], 1, tmp_path / "ws1")
    split = run_ranks_sequence(calls[2], 2, tmp_path / "ws2")
    for setup, one, two in zip(setups, whole, split, strict=True):
        assert (two["targets"], two["tokens"]) == (one["targets"], one["tokens"]), setup
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5), setup
        assert relative_difference(two["grads"], one["grads"]) <= 1e-5, setup
        assert (two["aux"] is None) == (one["aux"] is None) == (setup[2] != "the load-balancing loss"), setup
        if one["aux"] is not None:
            assert two["aux"] == pytest.approx(one["aux"], rel=1e-5) and one["aux"] > 0.5, setup
