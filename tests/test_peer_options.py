"""The options peers let users choose, each against its reference at world sizes 1 and 2: one pool task a world
size runs every check (LoRA+'s groups and step, NEFTune's noise)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from peft.optimizers import create_loraplus_optimizer
from transformers import AutoModelForCausalLM
from transformers.integrations.neftune import neftune_post_forward_hook

from qlora_fsdp.loading.adapter import gather_trainable_state
from qlora_fsdp.loading.factory import build_model
from qlora_fsdp.loading.names import clean_name
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.training.loop import accumulate_gradients
from qlora_fsdp.training.optimizer import build_optimizer, clip_grad_norm, parameter_groups
from tests.helpers import (
    batches,
    full_grads,
    relative_difference,
    run_ranks_sequence,
    tiny_config,
    variable_length_samples,
)

pytestmark = pytest.mark.slow  # gloo ranks

PAD = 2
PLUS_RATIO, LR, WEIGHT_DECAY = 16.0, 1e-3, 0.1
NEFTUNE_ALPHA = 5.0


# ---- inside the ranks -----------------------------------------------------------------------------------------

def loraplus_step(info, cfg, per_rank):
    """One optimizer step of the recipe's optimizer (8-bit AdamW on host shards) with LoRA+ groups: the update
    of every trained tensor beside its gradient and its value before."""
    model = build_model(cfg, info)
    before = gather_trainable_state(model)
    accumulate_gradients(model, per_rank[info.rank], info.device)
    grads = full_grads(model)
    clip_grad_norm(model, None)
    optimizer = build_optimizer(model, cfg.optim, cfg.lora)
    optimizer.step()
    after = gather_trainable_state(model)
    faster = {clean_name(name) for name, param in model.named_parameters() if any(param is p for p in optimizer.params[
        len(optimizer.inner.param_groups[0]["params"]):])}
    return {"before": before, "grads": grads, "delta": {k: after[k] - before[k] for k in before},
            "faster": faster, "lrs": [group["lr"] for group in optimizer.inner.param_groups],
            "optimizer": type(optimizer.inner).__name__}


def neftune_against_transformers(info, cfg, per_rank):
    """Loss and gradients of a micro-batch with our noise, and with transformers' hook on a model built without
    it, from the same generator state; and without any noise (the check can fail)."""
    results = {}
    for name, alpha in (("ours", cfg.train.neftune_alpha), ("transformers", None), ("none", None)):
        cfg.train.neftune_alpha = alpha
        model = build_model(cfg, info)
        if name == "transformers":
            embeddings = model.get_input_embeddings()
            embeddings.neftune_noise_alpha = NEFTUNE_ALPHA
            embeddings.register_forward_hook(neftune_post_forward_hook)
        torch.manual_seed(1234 + info.rank)
        result = accumulate_gradients(model, per_rank[info.rank], info.device)
        results[name] = {"loss": result.loss, "grads": full_grads(model)}
    cfg.train.neftune_alpha = NEFTUNE_ALPHA
    model = build_model(cfg, info)
    with torch.no_grad():  # in training mode, as a reference forward runs
        results["no_grad_losses"] = [seeded_loss(model, per_rank[info.rank][0], info.device, seed)
                                     for seed in (0, 1)]
    results["grad_losses"] = [seeded_loss(model, per_rank[info.rank][0], info.device, seed).detach()
                              for seed in (0, 1)]
    return results


def seeded_loss(model, batch, device, seed):
    torch.manual_seed(seed)
    return ForwardLoss()(model, batch, device)


def peer_option_checks(info, calls):
    return {name: fn(info, *args) for name, (fn, args) in calls.items()}


# ---- the checks -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def option_runs(tiny_model_dir, tmp_path_factory):
    """Every check's results at world sizes 1 and 2 (one pool task each)."""
    cfg = tiny_config(tiny_model_dir)
    samples = variable_length_samples(cfg, 8)
    per_rank = [batches(samples[:4], 4, PAD), batches(samples[4:8], 4, PAD)]
    whole = [per_rank[0] + per_rank[1]]
    loraplus = tiny_config(tiny_model_dir, lora={"plus_ratio": PLUS_RATIO, "use_dora": True},
                           optim={"lr": LR, "weight_decay": WEIGHT_DECAY})
    neftune = tiny_config(tiny_model_dir, train={"neftune_alpha": NEFTUNE_ALPHA})
    runs = {}
    for world_size, data in ((1, whole), (2, per_rank)):
        calls = {"loraplus": (loraplus_step, (loraplus, data)), "neftune": (neftune_against_transformers,
                                                                             (neftune, per_rank))}
        runs[world_size] = run_ranks_sequence([(peer_option_checks, (calls,))], world_size,
                                              tmp_path_factory.mktemp(f"ws{world_size}"))[0]
    return runs


def hand_computed_adamw(run: dict, lr_of) -> dict[str, torch.Tensor]:
    """AdamW's first step: m/(sqrt(v)+eps) is g/(|g|+eps) after bias correction; decoupled decay of lr*wd*p."""
    return {name: -lr_of(name) * (run["grads"][name] / (run["grads"][name].abs() + 1e-8)
                                  + WEIGHT_DECAY * run["before"][name]) for name in run["delta"]}


@pytest.mark.parametrize("world_size", [1, 2])
def test_loraplus_groups_and_step(option_runs, tiny_model_dir, world_size):
    """B matrices and DoRA's magnitudes step at 16x the rate, A matrices at the rate: the groups are PEFT's
    create_loraplus_optimizer's on the same model, and one 8-bit AdamW step equals the hand-computed one."""
    run = option_runs[world_size]["loraplus"]
    assert run["optimizer"] == "AdamW8bit" and run["lrs"] == [LR, LR * PLUS_RATIO]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           PeftLoraConfig(r=16, lora_alpha=32, target_modules="all-linear", use_dora=True))
    peft_optimizer = create_loraplus_optimizer(model, torch.optim.AdamW, lr=LR, loraplus_lr_ratio=PLUS_RATIO)
    names = {id(param): name for name, param in model.named_parameters()}
    peft_faster = {names[id(p)] for group in peft_optimizer.param_groups if group["lr"] == LR * PLUS_RATIO
                   for p in group["params"]}
    assert peft_faster and run["faster"] == peft_faster
    expected = hand_computed_adamw(run, lambda name: LR * (PLUS_RATIO if name in peft_faster else 1.0))
    assert relative_difference(run["delta"], expected) <= 1e-5
    one_rate = hand_computed_adamw(run, lambda name: LR)
    assert relative_difference(run["delta"], one_rate) > 0.5  # without LoRA+ the step differs
    assert relative_difference(run["delta"], option_runs[1]["loraplus"]["delta"]) <= 1e-5


def test_loraplus_groups_by_name():
    """Plain LoRA keeps one group; LoRA+ sends lora_B (also an experts parameter named lora_B) and vectors to the
    faster group."""
    from qlora_fsdp.config import LoraConfig

    named = [("a.lora_A.default.weight", torch.nn.Parameter(torch.zeros(2, 2))),
             ("a.lora_B.default.weight", torch.nn.Parameter(torch.zeros(2, 2))),
             ("experts.lora_B", torch.nn.Parameter(torch.zeros(2, 2))),
             ("a.lora_magnitude_vector.default.weight", torch.nn.Parameter(torch.zeros(2))),
             ("frozen", torch.nn.Parameter(torch.zeros(2), requires_grad=False))]
    plain = parameter_groups(named, LoraConfig())
    assert [len(group.params) for group in plain] == [4]
    plus = parameter_groups(named, LoraConfig(plus_ratio=4.0))
    assert [(group.lr_ratio, len(group.params)) for group in plus] == [(1.0, 1), (4.0, 3)]


@pytest.mark.parametrize("world_size", [1, 2])
def test_neftune_noise_is_transformers(option_runs, world_size):
    """The same generator gives our noise and transformers' hook the same loss and gradients; they differ from
    the noiseless ones, and a held-out forward (no gradients) sees no noise."""
    run = option_runs[world_size]["neftune"]
    assert run["ours"]["loss"] == pytest.approx(run["transformers"]["loss"], rel=1e-6)
    assert relative_difference(run["ours"]["grads"], run["transformers"]["grads"]) <= 1e-5
    assert abs(run["ours"]["loss"] - run["none"]["loss"]) > 1e-4 * run["none"]["loss"]
    assert relative_difference(run["ours"]["grads"], run["none"]["grads"]) > 1e-3
    assert run["no_grad_losses"][0] == run["no_grad_losses"][1]
    assert run["grad_losses"][0] != run["grad_losses"][1]
