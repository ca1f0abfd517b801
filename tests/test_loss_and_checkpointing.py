"""Memory levers change memory, never numbers: chunked loss vs full logits, every checkpointing policy vs none,
and the activation bytes each policy keeps."""

from __future__ import annotations

import re

import pytest

from qlora_fsdp.data.batching import collate_packed
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.objectives.supervised import accumulate_gradients
from tests.helpers import (
    batches,
    fp32_reordering_bound,
    full_grads,
    relative_difference,
    run_ranks_sequence,
    tiny_config,
    variable_length_samples,
)

PAD = 2

# (name, activation_checkpointing keys): which layers and what inside them; the tiny model has 2 layers
POLICIES = [
    ("every layer", {"mode": "every_layer"}),
    ("attention only", {"mode": "every_layer", "scope": "attention"}),
    ("MLP only", {"mode": "every_layer", "scope": "mlp"}),
    ("matmul outputs saved (per operator)", {"mode": "every_layer", "scope": "ops"}),
    ("every 2nd layer", {"mode": "every_nth", "every_n": 2}),
    ("first and last 1", {"mode": "first_last", "first_last": 1}),
    ("explicit list [1]", {"mode": "layers", "layers": [1]}),
    ("MLP in 7-token tiles, every layer checkpointed", {"mode": "every_layer", "mlp_tile_tokens": 7}),
    ("MLP in 7-token tiles, MLP checkpointed", {"mode": "every_layer", "scope": "mlp", "mlp_tile_tokens": 7}),
    ("MLP in 7-token tiles, nothing checkpointed", {"mode": "off", "mlp_tile_tokens": 7}),
    ("attention side in 7-token tiles, every layer checkpointed", {"mode": "every_layer", "attention_tile_tokens": 7}),
    ("attention side and MLP in 5-token tiles, nothing checkpointed",
     {"mode": "off", "attention_tile_tokens": 5, "mlp_tile_tokens": 5}),
]


def loss_and_grads(info, cfg, micro_batches_per_rank, chunk_tokens):
    """The step's loss and gradients, and how often the first layer's MLP ran its down projection and its attention
    the 4-bit matmul of its query projection (once a tile)."""
    model = build_sharded_model(cfg, info)
    # the modules under whatever wrappers checkpointing and FSDP2 put around the layer or its sub-layers
    calls = {"mlp_runs": 0, "q_runs": 0}
    for key, pattern in (("mlp_runs", r"down_proj$"), ("q_runs", r"q_proj\.base_layer$")):
        found = next(m for name, m in model.named_modules() if re.search(r"layers\.0\.(.+\.)?" + pattern, name))
        found.register_forward_hook(lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
    result = accumulate_gradients(model, micro_batches_per_rank[info.rank], info.device, ForwardLoss(chunk_tokens))
    return {"loss": result.loss, "grads": full_grads(model), **calls}


def activation_bytes(info, cfg, batch):
    """Bytes the forward leaves alive for backward (live tensor bytes after it, less before), by torch's tracker."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class ForwardTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # its gradient hooks need every parameter to require grad; the frozen 4-bit base does not
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    model = build_sharded_model(cfg, info)
    tracker = ForwardTracker()
    tracker.track_external(model)
    with tracker:
        before = tracker.get_tracker_snapshot()[info.device]["Total"]
        loss = ForwardLoss(cfg.loss.chunk_tokens)(model, batch, info.device)
        after = tracker.get_tracker_snapshot()[info.device]["Total"]
        loss.backward()
    return after - before


@pytest.fixture(scope="module")
def samples(tiny_model_dir):
    return variable_length_samples(tiny_config(tiny_model_dir), 16)


def step_tokens(samples) -> int:
    """The tokens of a step over them all: the longest sum behind its gradients (and its loss)."""
    return sum(len(s.input_ids) for s in samples)


def per_rank_batches(samples, world_size, packed):
    """Each rank's micro-batches: padded samples, or rows of several samples each."""
    share = len(samples) // world_size
    mine = [samples[r * share:(r + 1) * share] for r in range(world_size)]
    if packed:
        return [[collate_packed([s[i:i + 2] for i in range(0, len(s), 2)], PAD)] for s in mine]
    return [batches(s, 4, PAD) for s in mine]


@pytest.mark.slow  # gloo ranks
@pytest.mark.parametrize("world_size", [1, 2])
def test_chunked_loss_equals_full_loss(tiny_model_dir, samples, tmp_path, world_size):
    """Chunks that split rows and samples (5 tokens), and one chunk bigger than the batch; padded and packed."""
    cfg = tiny_config(tiny_model_dir, activation_checkpointing={"mode": "off"})
    results: dict = {}
    bound = fp32_reordering_bound(step_tokens(samples))  # chunks change the head's matmuls: summation order only
    # the big chunk in a task of its own, after: a loss that lost its last, shorter chunk has no chunk at all there
    # and fails to run, which would hide the wrong numbers of the 5-token chunks
    for chunks in ((None, 5), (4096,)):
        setups = [(packed, chunk) for packed in (False, True) for chunk in chunks]
        calls = [(loss_and_grads, (cfg, per_rank_batches(samples, world_size, packed), chunk))
                 for packed, chunk in setups]
        results |= dict(zip(setups, run_ranks_sequence(calls, world_size, tmp_path), strict=True))
        for packed, chunk in setups:
            full = results[(packed, None)]
            assert results[(packed, chunk)]["loss"] == pytest.approx(full["loss"], rel=bound)
            assert relative_difference(results[(packed, chunk)]["grads"], full["grads"]) <= bound


@pytest.mark.slow  # gloo ranks
def test_every_checkpointing_policy_equals_none(tiny_model_dir, samples, tmp_path):
    """Two ranks (FSDP2 around the wrapped layers and sub-layers), chunked loss, packed rows."""
    per_rank = per_rank_batches(samples, 2, packed=True)
    policies = [("none", {"mode": "off"}), *POLICIES]
    calls = [(loss_and_grads, (tiny_config(tiny_model_dir, activation_checkpointing=keys), per_rank, 64))
             for _, keys in policies]
    results = dict(zip([name for name, _ in policies], run_ranks_sequence(calls, 2, tmp_path), strict=True))
    # tiles change the matmuls' shapes, and so the kernels' summation order (1e-6 failed on an AMX CPU)
    bound = fp32_reordering_bound(step_tokens(samples))
    for name, _ in POLICIES:
        assert results[name]["loss"] == pytest.approx(results["none"]["loss"], rel=bound), name
        assert relative_difference(results[name]["grads"], results["none"]["grads"]) <= bound, name
        # the tiles ran: each runs its modules in forward and again in backward
        for runs, tiled in (("mlp_runs", "MLP"), ("q_runs", "attention side")):
            if tiled in name and "tiles" in name:
                assert results[name][runs] > 4 * results["none"][runs], (name, runs, results[name][runs])
            else:
                assert results[name][runs] <= 3 * results["none"][runs], (name, runs, results[name][runs])


@pytest.mark.slow  # gloo ranks
def test_activation_bytes_order_none_then_selective_then_every_layer(tmp_path):
    """What the forward keeps for backward: none > each selective policy > every layer (a model with a
    hidden size large enough that activations, not bookkeeping, dominate)."""
    from tests.helpers import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(tmp_path / "tiny4", layers=4)
    samples = variable_length_samples(tiny_config(model_dir), 8)
    batch = collate_packed([samples[i:i + 4] for i in range(0, 8, 4)], PAD)
    policies = [("none", {"mode": "off"}), *POLICIES[:4], ("every 2nd layer", {"mode": "every_nth"})]
    calls = [(activation_bytes, (tiny_config(model_dir, activation_checkpointing=keys), batch)) for _, keys in policies]
    kept = dict(zip([name for name, _ in policies], run_ranks_sequence(calls, 1, tmp_path), strict=True))
    for name in ("attention only", "MLP only", "matmul outputs saved (per operator)", "every 2nd layer"):
        assert kept["none"] > kept[name] > kept["every layer"], (name, kept)


def test_checkpointing_names_a_layer_the_model_lacks_in_one_line(tiny_model_dir):
    from qlora_fsdp.errors import ConfigError
    from qlora_fsdp.layers.checkpointing import apply_activation_checkpointing
    from qlora_fsdp.loading.build import build_meta_model
    from qlora_fsdp.loading.checkpoint import load_hf_config

    cfg = tiny_config(tiny_model_dir, activation_checkpointing={"mode": "layers", "layers": [0, 2]})
    model = build_meta_model(cfg, load_hf_config(cfg))
    with pytest.raises(ConfigError, match="names layer 2, but the model has 2"):
        apply_activation_checkpointing(model, cfg.activation_checkpointing)
