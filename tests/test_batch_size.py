"""Effective batch -> micro-batch x accumulation x ranks; the auto micro-batch; learning-rate scaling."""

from __future__ import annotations

import pytest

from qlora_fsdp.config import load_config, to_yaml
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.run.batch_size import describe_batch, resolve_batch
from tests.helpers import run_ranks, tiny_config

TARGET = ["data.grad_accum_steps=1", "data.effective_batch=32"]


@pytest.mark.parametrize(("world", "micro", "accum"), [(1, 4, 8), (2, 4, 4), (4, 4, 2), (8, 4, 1)])
def test_effective_batch_sets_the_accumulation_for_any_world_size(world, micro, accum):
    cfg = load_config("tiny_cpu", [*TARGET, "data.micro_batch_size=4"])
    resolved = resolve_batch(cfg, world)
    assert (resolved.data.micro_batch_size, resolved.data.grad_accum_steps) == (micro, accum)
    assert micro * accum * world == 32
    assert describe_batch(cfg, resolved, world).startswith(f"batch: micro-batch 4 x {accum} accumulation steps")


def test_resolved_config_loads_back_as_it_is(tmp_path):
    """What checkpoints and adapters save (config.yaml, training_config.yaml) must load for resume, merge and
    generate: concrete micro-batch and accumulation, no target left to derive them again."""
    cfg = load_config("tiny_cpu", [*TARGET, "data.micro_batch_size=4", "optim.lr_scaling=sqrt",
                                   "optim.lr_base_batch=8"])
    resolved = resolve_batch(cfg, 2)
    saved = tmp_path / "training_config.yaml"
    saved.write_text(to_yaml(resolved))
    reloaded = load_config(str(saved))
    assert reloaded == resolved and reloaded.data.grad_accum_steps == 4
    assert resolve_batch(reloaded, 2) == resolved


def test_effective_batch_in_tokens():
    cfg = load_config("tiny_cpu", ["data.grad_accum_steps=1", "data.effective_batch_tokens=4096",
                                   "data.micro_batch_size=2"])  # context_length 128: 32 rows
    assert resolve_batch(cfg, 2).data.grad_accum_steps == 8
    odd = load_config("tiny_cpu", ["data.grad_accum_steps=1", "data.effective_batch_tokens=4000"])
    with pytest.raises(ConfigError, match="not a multiple of data.context_length 128: use 3968 or 4096"):
        resolve_batch(odd, 2)


def test_batches_that_do_not_split_name_the_ones_that_do():
    with pytest.raises(ConfigError, match="does not split over 3 ranks: use data.effective_batch=30 or "
                                          "data.effective_batch=33"):
        resolve_batch(load_config("tiny_cpu", TARGET), 3)
    with pytest.raises(ConfigError, match="micro_batch_size 3 does not divide the 16 rows each rank takes per "
                                          "step: choose one of 1, 2, 4, 8, 16, or auto"):
        resolve_batch(load_config("tiny_cpu", [*TARGET, "data.micro_batch_size=3"]), 2)


def test_auto_takes_the_largest_divisor_that_fits():
    cfg = load_config("tiny_cpu", [*TARGET, "data.micro_batch_size=auto"])
    asked = []

    def fits(micro: int) -> bool:
        asked.append(micro)
        return micro <= 5

    resolved = resolve_batch(cfg, 2, fits)
    assert (resolved.data.micro_batch_size, resolved.data.grad_accum_steps) == (4, 4)
    assert sorted(asked) == [1, 2, 4, 8, 16]  # only divisors of the 16 rows a rank: no ragged last micro-batch
    assert "(auto: the largest that fits)" in describe_batch(cfg, resolved, 2)
    with pytest.raises(ConfigError, match="not even micro-batch 1 fits"):
        resolve_batch(cfg, 2, lambda micro: False)


@pytest.mark.parametrize(("scaling", "factor"), [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_lr_scales_with_the_effective_batch(scaling, factor):
    cfg = load_config("tiny_cpu", [*TARGET, f"optim.lr_scaling={scaling}", "optim.lr_base_batch=8"])
    resolved = resolve_batch(cfg, 2)
    assert resolved.optim.lr == pytest.approx(cfg.optim.lr * factor)
    assert resolved.optim.lr_scaling == "none"  # the resolved config (saved with checkpoints) is never rescaled
    assert resolve_batch(resolved, 2).optim.lr == resolved.optim.lr


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.micro_batch_size=auto"], "'data.micro_batch_size: auto' needs a target"),
    (["data.effective_batch=8", "data.effective_batch_tokens=1024", "data.grad_accum_steps=1"], "not both"),
    (["data.effective_batch=8"], "'data.grad_accum_steps: 2' and an effective batch are both set"),
    (["optim.lr_scaling=linear"], "needs 'optim.lr_base_batch'"),
    (["data.micro_batch_size=big"], "'data.micro_batch_size' must be an integer or 'auto', got 'big'"),
    (["fsdp.shard_size=0"], "'fsdp.shard_size' must be at least 1"),
])
def test_batch_settings_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("tiny_cpu", overrides)


def planned_micro_batches(info, cfg):
    """On a fake rank: the auto choice, and the planned totals of every candidate."""
    from qlora_fsdp.measure.held import meta_held
    from qlora_fsdp.measure.planning import Planning
    from qlora_fsdp.plan.memory import micro_batch_fits, plan, with_micro_batch

    planning = Planning.of(cfg)
    cfg, held = planning.cfg, meta_held(planning, info.mesh)
    chosen = resolve_batch(cfg, info.world_size, micro_batch_fits(planning, cfg, held)).data.micro_batch_size
    totals = {m: plan(planning, with_micro_batch(cfg, m), held).gpu_total for m in (1, 2, 4, 8, 16)}
    return chosen, totals


@pytest.mark.slow
def test_auto_by_the_planner_picks_the_largest_planned_to_fit(tiny_model_dir, tmp_path):
    # context 4096 on the tiny model: activations grow with the micro-batch while the weights stay ~MB
    cfg = tiny_config(tiny_model_dir, data={"micro_batch_size": "auto", "effective_batch": 32,
                                            "context_length": 4096}, hardware={"gpu": "rtx4090", "gpus_per_node": 2})
    cfg.hardware.gpu_memory_gib = 1.5
    chosen, totals = run_ranks(planned_micro_batches, 2, cfg, tmp_dir=tmp_path, fake=True)[0]
    limit = 1.5 * 2**30
    assert totals[chosen] <= limit < totals[chosen * 2], totals
    assert 1 < chosen < 16


def test_auto_at_launch_sizes_for_the_memory_this_process_can_have(monkeypatch, capsys):
    """A 24 GiB GPU that also drives a display: auto sizes for what is free plus what this run holds already
    (its shards, which the plan counts itself), not for the whole card. CUDA is faked: no GPU needed."""
    import types

    import torch

    from qlora_fsdp.auto_batch import this_run_hardware
    from qlora_fsdp.distributed import DistInfo
    from qlora_fsdp.plan.memory import CUDA_CONTEXT_GIB

    gib, reserved = 2**30, 5 * 2**30
    cfg = load_config("tiny_cpu", [*TARGET, "data.micro_batch_size=auto"])
    info = DistInfo(0, 0, 1, torch.device("cuda", 0), mesh=None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(
        total_memory=24 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)

    def planned_gib(held_by_others: float) -> float:
        free = 24 * gib - held_by_others * gib - CUDA_CONTEXT_GIB * gib - reserved
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free), 24 * gib))
        return this_run_hardware(cfg, info).gpu_memory_gib

    assert planned_gib(0) == 24 and capsys.readouterr().out == ""
    assert planned_gib(1.5) == 22.5
    assert "sized for 22.5 GiB of this GPU's 24.0 GiB" in capsys.readouterr().out


def test_halving_advice_fits_a_recipe_with_an_effective_batch():
    """A misfit's 'halve the micro-batch' advice must be something the recipe accepts: with an effective batch,
    grad_accum_steps is derived, so naming it would be refused."""
    from qlora_fsdp.plan.levers import variants

    resolved = resolve_batch(load_config("tiny_cpu", [*TARGET, "data.micro_batch_size=4"]), 2)
    label, keys, changed = next(lever for lever in variants(resolved, batch_from_target=True)
                                if lever[0].startswith("data.micro_batch_size"))
    assert keys == {"data.micro_batch_size": 2}  # what the studio's button sets: the derived steps are not a key
    assert label == "data.micro_batch_size=2 (the effective batch then takes 8 accumulation steps)"
    assert (changed.data.micro_batch_size, changed.data.grad_accum_steps) == (2, 8)
    load_config("tiny_cpu", [*TARGET, label.split()[0]])  # the advice, applied, is accepted
    plain = variants(load_config("tiny_cpu"))
    assert any(lever[0] == "data.micro_batch_size=2 data.grad_accum_steps=4 (same effective batch)" for lever in plain)
