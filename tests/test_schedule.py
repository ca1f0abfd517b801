"""The learning-rate schedule (optimizer.py): optim.warmup_ratio against its warmup steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qlora_fsdp.config import OptimConfig, load_config
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.optimizer import ParameterGroup, ShardedOptimizer, build_scheduler, lr_factor, warmup_steps


def scheduler_lrs(optim: OptimConfig, total_steps: int) -> list[float]:
    """The learning rate of each optimizer step, from the scheduler training builds."""
    optimizer = ShardedOptimizer([ParameterGroup(1.0, [nn.Parameter(torch.zeros(4))])], optim)
    scheduler = build_scheduler(optimizer, optim, total_steps)
    lrs = []
    for _ in range(total_steps):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("scheduler", ["cosine", "linear", "constant"])
def test_warmup_ratio_is_the_same_schedule_as_its_warmup_steps(scheduler):
    by_ratio = OptimConfig(name="adamw", lr=1e-3, scheduler=scheduler, warmup_ratio=0.1)
    by_steps = OptimConfig(name="adamw", lr=1e-3, scheduler=scheduler, warmup_steps=3)
    lrs = scheduler_lrs(by_ratio, 30)  # 0.1 x 30 steps: 3 warmup steps (3.0000000000000004 in floats)
    assert lrs == scheduler_lrs(by_steps, 30)
    assert lrs[2] == pytest.approx(0.75e-3) and lrs[3] == pytest.approx(1e-3)  # last warmup step, first after


def test_warmup_ratio_rounds_up_to_whole_steps():
    assert [warmup_steps(OptimConfig(warmup_ratio=r), 30) for r in (0.0, 0.05, 0.1, 0.5)] == [0, 2, 3, 15]
    assert warmup_steps(OptimConfig(warmup_steps=7), 30) == 7
    assert lr_factor(1, OptimConfig(warmup_ratio=0.05), 30) == pytest.approx(2 / 3)


@pytest.mark.parametrize(("overrides", "message"), [
    (["optim.warmup_ratio=0.1"], "'optim.warmup_steps: 10' and 'optim.warmup_ratio: 0.1' are both set"),
    (["optim.warmup_steps=0", "optim.warmup_ratio=1"], "'optim.warmup_ratio' must be at least 0 and below 1"),
    (["optim.warmup_steps=0", "optim.warmup_ratio=-0.1"], "'optim.warmup_ratio' must be at least 0 and below 1"),
])
def test_bad_warmup_settings_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:  # tiny_cpu sets warmup_steps: 10
        load_config("tiny_cpu", overrides)
    assert "\n" not in str(err.value)
    assert load_config("tiny_cpu", ["optim.warmup_steps=0", "optim.warmup_ratio=0.05"]).optim.warmup_ratio == 0.05
