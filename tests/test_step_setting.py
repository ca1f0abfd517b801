"""The keys a plan keeps its measurements under (measure/step_setting.py's step, measure/image_side.py's image side):
every recipe key turned alone, each key held to what is measured. It changes where the measurement changes, and
nowhere else: the keys whose turn leaves the key as it was are turned all together and measured once (the same
step); each key whose turn changes the key is measured alone (another step)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from qlora_fsdp.config import Config, load_config
from tests.config_changes import changes, other_value
from tests.helpers import REPO, run_ranks
from tests.test_step_memory import architecture

# the step reads these, and a tiny dense text recipe in float32 cannot show it: the key keeps them (a measurement
# taken again is the cost of a key read needlessly; a key left out would hand a plan another setting's step)
NOT_SHOWN = {
    "lora.compute_dtype": "weights or base: one dtype where lora.dtype is the compute dtype (float32 here)",
}
# keys in the step key measured elsewhere: the key must change when they do
NOT_MEASURED = {
    "lora.target_experts": "a mixture of experts' (a dense model refuses it; tests/test_step_memory.py plans one)",
    "lora.train_router": "a mixture of experts'",
    "hardware.gpus_per_node": "the world's size: fake worlds of their own sizes (tests/test_batch_size.py)",
    "hardware.nodes": "the world's size",
}
TINY_MODEL = REPO / "models" / "tiny-llama"


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory) -> Config:
    """tiny_cpu on a Llama of 2 layers (the tiny model's tokenizer) in float32 at world size 2; a second folder of
    the same config.json."""
    folder = architecture(tmp_path_factory.mktemp("step_setting") / "llama", layers=2, hidden=64, heads=4,
                          kv_heads=2, vocab=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # model.add_tokens reads it
        shutil.copy(TINY_MODEL / name, folder / name)
    shutil.copytree(folder, folder.with_name("same_llama"))
    return load_config("tiny_cpu", [f"model.path={folder}", "model.init=random", "hardware.gpus_per_node=2",
                                    "model.dtype=float32", "quant.compute_dtype=float32", "data.grad_accum_steps=1"])


def step_key(cfg: Config) -> str:
    """The key the plan of `cfg` keeps its step under."""
    from qlora_fsdp.measure.planning import Planning
    from qlora_fsdp.measure.step_setting import step_setting

    planning = Planning.of(cfg)
    return step_setting(planning.built(planning.cfg), planning.hf_config)


def measured_steps(info, base: Config, turned: dict[str, Config], alone: list[str], together: list[str]):
    """On rank 0 of a fake world of 2: whether each key in `alone`, turned, changes the base's measured step; and
    whether the keys in `together`, all turned at once, leave it as it was."""
    from qlora_fsdp.measure.fake_world import recipe_step
    from qlora_fsdp.measure.planning import Planning

    base_step = recipe_step(Planning.of(base))
    changed = {name: recipe_step(Planning.of(turned[name])) != base_step for name in alone}
    all_at_once = base
    for name in together:
        all_at_once = taken(all_at_once, turned[name], name)
    return changed, recipe_step(Planning.of(all_at_once)) == base_step


def taken(cfg: Config, source: Config, dotted: str) -> Config:
    """`cfg` with `source`'s value of the key."""
    section, _, key = dotted.partition(".")
    if not key:
        return dataclasses.replace(cfg, **{section: getattr(source, section)})
    value = getattr(getattr(source, section), key)
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{key: value})})


@pytest.mark.slow
def test_the_step_key_changes_exactly_where_the_measured_step_does(two_layers, tmp_path):
    from qlora_fsdp.measure.step_setting import STEP_UNREAD

    base = two_layers
    turned = dict(changes(base))
    turned["model.path"] = dataclasses.replace(base, model=dataclasses.replace(
        base.model, path=str(Path(base.model.path).with_name("same_llama"))))
    base_key = step_key(base)
    key_changed = {name: step_key(cfg) != base_key for name, cfg in turned.items()}
    together = [name for name, changes_key in key_changed.items() if not changes_key]
    alone = [name for name, changes_key in key_changed.items() if changes_key and name not in NOT_MEASURED]
    step_changed, together_same = run_ranks(measured_steps, 2, base, turned, alone, together, tmp_dir=tmp_path,
                                            fake=True, timeout=900)[0]
    assert together_same, f"the keys the step key leaves out changed the step, turned together: {together}"
    needless = sorted(name for name, changes_step in step_changed.items() if not changes_step)
    assert needless == sorted(NOT_SHOWN), f"keys in the step key that change no step here: {needless}"
    assert all(key_changed[name] for name in NOT_MEASURED)
    assert STEP_UNREAD <= set(together), sorted(STEP_UNREAD - set(together))  # each turned: the key stays


def test_every_recipe_key_has_a_value_to_turn_to(two_layers):
    """tests/config_changes.py turns every key: a key added to the schema gets its other value there."""
    from tests.config_changes import leaves

    for dotted, value, hint in leaves(two_layers):
        assert other_value(dotted, value, hint) != value, dotted
