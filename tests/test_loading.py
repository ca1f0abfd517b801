"""The streaming loader: model families, architecture-only runs, safe formats, and clear errors."""

from __future__ import annotations

import json
import shutil

import bitsandbytes as bnb
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from qlora_fsdp.distributed import local_shard
from qlora_fsdp.errors import ModelLoadError
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.losses.forward import loss_sum
from tests.helpers import (
    batches,
    build_tiny_checkpoint,
    run_ranks,
    run_ranks_sequence,
    tiny_config,
    variable_length_samples,
)

pytestmark = pytest.mark.slow  # every test loads on gloo ranks or in a subprocess

PAD = 2


def sharded_loss(info, cfg, batch):
    model = build_sharded_model(cfg, info)
    with torch.no_grad():
        return loss_sum(model, batch, info.device).item() / batch.n_targets


def peer_loss(model_dir, batch) -> float:
    """transformers' own 4-bit load of the checkpoint: what our streamed, sharded load must equal."""
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, dtype=torch.bfloat16)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        return loss_sum(model, batch, torch.device("cpu")).item() / batch.n_targets


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def test_families_load_sharded_like_transformers(tmp_path):
    calls, references = [], {}
    for family in FAMILIES:  # one 2-rank start-up for all four: each call builds its own model
        model_dir = build_tiny_checkpoint(tmp_path / family, family=family, max_shard_size="300KB")
        assert len(list(model_dir.glob("*.safetensors"))) > 1  # several shards, through the index
        cfg = tiny_config(model_dir, model={"dtype": "bfloat16"}, quant={"compute_dtype": "bfloat16"})
        batch = batches(variable_length_samples(cfg, 8), 8, PAD)[0]
        calls.append((sharded_loss, (cfg, batch)))
        references[family] = peer_loss(model_dir, batch)
    ranks = run_ranks_sequence(calls, 2, tmp_path, all_ranks=True)
    for family, ours0, ours1 in zip(FAMILIES, ranks[0], ranks[1], strict=True):
        assert ours0 == ours1, family
        assert ours0 == pytest.approx(references[family], rel=1e-3), family


def test_random_init_needs_only_config_and_is_world_size_independent(tiny_model_dir, tmp_path):
    arch_only = tmp_path / "arch"
    arch_only.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, arch_only / name)
    cfg = tiny_config(arch_only, model={"init": "random"})
    batch = batches(variable_length_samples(cfg, 4), 4, PAD)[0]
    two = run_ranks(sharded_loss, 2, cfg, batch, tmp_dir=tmp_path)
    one = run_ranks(sharded_loss, 1, cfg, batch, tmp_dir=tmp_path)
    assert two[0] == pytest.approx(one[0], rel=1e-6)
    assert 3.0 < one[0] < 10.0  # a sane, untrained model: about ln(vocab), not NaN or 0


def local_shards(info, cfg):
    """Every base parameter's local shard on this rank, as raw bytes (plus each layer's quantization state)."""
    model = build_sharded_model(cfg, info)
    shards = {name: local_shard(p).detach().clone()
              for name, p in model.named_parameters() if not p.requires_grad}
    shards.update({f"{name}.absmax": m.quant_state.absmax.clone() for name, m in model.named_modules()
                   if isinstance(m, bnb.nn.Linear4bit)})
    return shards


def test_fake_world_rank_holds_what_the_real_rank_holds(tiny_model_dir, tmp_path):
    """What benchmarks/load_as_rank.py measures on one device is what rank 0 of a real 2-rank run holds."""
    cfg = tiny_config(tiny_model_dir, model={"dtype": "bfloat16"})
    real = run_ranks(local_shards, 2, cfg, tmp_dir=tmp_path)[0]
    fake = run_ranks(local_shards, 2, cfg, tmp_dir=tmp_path, fake=True)[0]
    whole = run_ranks(local_shards, 1, cfg, tmp_dir=tmp_path)[0]
    assert fake.keys() == real.keys() and len(real) > 20
    for name, tensor in real.items():
        assert torch.equal(fake[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert sum(t.numel() for t in fake.values()) < 0.6 * sum(t.numel() for t in whole.values())


def _loader_error(info, cfg):
    try:
        build_sharded_model(cfg, info)
    except ModelLoadError as err:
        return str(err)
    return None


def _copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_pickle_weights_refused_unless_allowed(tiny_model_dir, tmp_path):
    pickled = _copy_checkpoint(tiny_model_dir, tmp_path / "pickled")
    state = load_file(pickled / "model.safetensors")
    (pickled / "model.safetensors").unlink()
    torch.save(state, pickled / "pytorch_model.bin")
    allowed = tiny_config(pickled, model={"allow_pickle": True})
    batch = batches(variable_length_samples(allowed, 4), 4, PAD)[0]
    message, reference, loaded = run_ranks_sequence(
        [(_loader_error, (tiny_config(pickled),)), (sharded_loss, (tiny_config(tiny_model_dir), batch)),
         (sharded_loss, (allowed, batch))], 1, tmp_path)
    assert "only pickle weights" in message and "model.allow_pickle=true" in message
    assert loaded == reference


def test_clear_errors(tiny_model_dir, tmp_path):
    cases = {}
    cases["missing path"] = (tiny_config(tmp_path / "nowhere"), "is not a checkpoint folder")
    no_weights = _copy_checkpoint(tiny_model_dir, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    cases["no weights"] = (tiny_config(no_weights), "has no weights (*.safetensors)")
    disagree = _copy_checkpoint(tiny_model_dir, tmp_path / "disagree")
    config = json.loads((disagree / "config.json").read_text())
    config["intermediate_size"] *= 2
    (disagree / "config.json").write_text(json.dumps(config))
    cases["config vs weights"] = (tiny_config(disagree), "config and weights disagree")
    sharded = build_tiny_checkpoint(tmp_path / "sharded", max_shard_size="300KB")
    missing_shard = sorted(sharded.glob("*.safetensors"))[-1]
    missing_shard.unlink()
    cases["missing shard"] = (tiny_config(sharded), f"names shard {missing_shard.name}, which is missing")
    messages = run_ranks_sequence([(_loader_error, (cfg,)) for cfg, _ in cases.values()], 1, tmp_path)
    for (name, (_, expected)), message in zip(cases.items(), messages, strict=True):
        assert message is not None and expected in message and "\n" not in message, (name, message)
