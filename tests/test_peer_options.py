"""The options peers let users choose, each against its reference at world sizes 1 and 2: one pool task a world
size runs every check (LoRA+'s groups and step, NEFTune's noise)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from peft.optimizers import create_loraplus_optimizer
from transformers import AutoModelForCausalLM
from transformers.integrations.neftune import neftune_post_forward_hook

from qlora_fsdp.config import to_yaml
from qlora_fsdp.data.batching import Sample
from qlora_fsdp.labels import IGNORE_INDEX
from qlora_fsdp.layers.trained_embeddings import embedding_parameters
from qlora_fsdp.loading.adapter import export_adapter, gather_trainable_state
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.loading.names import clean_name
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.objectives.supervised import accumulate_gradients
from qlora_fsdp.optimizer import build_optimizer, clip_grad_norm, parameter_groups
from tests.helpers import (
    batches,
    build_tiny_checkpoint,
    command_here,
    full_grads,
    relative_difference,
    run_ranks_sequence,
    tiny_config,
    transformers_nf4,
    variable_length_samples,
)
from tests.test_kto import set_adapter

pytestmark = pytest.mark.slow  # gloo ranks

PAD = 2
PLUS_RATIO, LR, WEIGHT_DECAY = 16.0, 1e-3, 0.1
NEFTUNE_ALPHA = 5.0
NEW_TOKENS, EMBEDDINGS_LR = ["<think>", "</think>"], 1e-4


def with_new_tokens(samples, new_ids):
    """Each sample with the new tokens inside it, the second as a target (so both rows of the embeddings and the
    head's row of the second get gradients)."""
    return [Sample(s.input_ids[:3] + new_ids + s.input_ids[3:], s.labels[:3] + [IGNORE_INDEX, new_ids[1]]
                   + s.labels[3:]) for s in samples]


# ---- inside the ranks -----------------------------------------------------------------------------------------

def loraplus_step(info, cfg, per_rank):
    """One optimizer step of the recipe's optimizer (8-bit AdamW on host shards) with LoRA+ groups: the update
    of every trained tensor beside its gradient and its value before."""
    model = build_sharded_model(cfg, info)
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
        model = build_sharded_model(cfg, info)
        if name == "transformers":
            embeddings = model.get_input_embeddings()
            embeddings.neftune_noise_alpha = NEFTUNE_ALPHA
            embeddings.register_forward_hook(neftune_post_forward_hook)
        torch.manual_seed(1234 + info.rank)
        result = accumulate_gradients(model, per_rank[info.rank], info.device)
        results[name] = {"loss": result.loss, "grads": full_grads(model)}
    cfg.train.neftune_alpha = NEFTUNE_ALPHA
    model = build_sharded_model(cfg, info)
    with torch.no_grad():  # in training mode, as a reference forward runs
        results["no_grad_losses"] = [seeded_loss(model, per_rank[info.rank][0], info.device, seed)
                                     for seed in (0, 1)]
    results["grad_losses"] = [seeded_loss(model, per_rank[info.rank][0], info.device, seed).detach()
                              for seed in (0, 1)]
    return results


def seeded_loss(model, batch, device, seed):
    torch.manual_seed(seed)
    return ForwardLoss()(model, batch, device)


def embeddings_step(info, cfg, per_rank, adapter_dir):
    """The embeddings and head trained beside LoRA, with two new tokens: their rows at the start, every gradient,
    one 8-bit AdamW step (32-bit state for them), the adapter saved, and the live model's logits after the step."""
    model = build_sharded_model(cfg, info)
    set_adapter(model)
    before = gather_trainable_state(model)
    accumulate_gradients(model, per_rank[info.rank], info.device)
    grads = full_grads(model)
    optimizer = build_optimizer(model, cfg.optim, cfg.lora)
    clip_grad_norm(model, None)
    optimizer.step()
    after = gather_trainable_state(model)
    embedding_ids = {id(p) for p in embedding_parameters(model)}
    state_dtypes = {str(optimizer.inner.state[local]["state1"].dtype)
                    for param, local in zip(optimizer.params, optimizer.locals, strict=True)
                    if id(param) in embedding_ids}
    export_adapter(model, load_tokenizer(cfg), adapter_dir, cfg.model.path, info.is_main, to_yaml(cfg))
    with torch.no_grad():
        logits = model(input_ids=per_rank[0][0].input_ids.to(info.device)).logits.float().cpu()
    return {"before": before, "grads": grads, "delta": {k: after[k] - before[k] for k in before},
            "state_dtypes": state_dtypes, "lrs": [g["lr"] for g in optimizer.inner.param_groups], "logits": logits}


def tied_embeddings_saved(info, cfg, adapter_dir):
    """A head tied to the embeddings (Qwen2's small models), trained with them: its one tensor moved and saved; the
    live model's logits."""
    model = build_sharded_model(cfg, info)
    with torch.no_grad():
        for param in embedding_parameters(model):
            param.add_(0.01)  # as a step would move it
    export_adapter(model, load_tokenizer(cfg), adapter_dir, cfg.model.path, info.is_main, to_yaml(cfg))
    ids = torch.tensor([[1, 5, 9, 512, 40]])
    with torch.no_grad():
        return {"ids": ids, "logits": model(input_ids=ids).logits[0].float(), "tensors": len(embedding_parameters(
            model))}


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
    embeddings = tiny_config(tiny_model_dir, model={"add_tokens": NEW_TOKENS},
                             lora={"train_embeddings": True, "embeddings_lr": EMBEDDINGS_LR, "dropout": 0.0},
                             optim={"lr": LR})
    tokenizer = load_tokenizer(embeddings)
    new_ids = tokenizer.convert_tokens_to_ids(NEW_TOKENS)
    with_new = [batches(with_new_tokens(samples[:4], new_ids), 4, PAD), batches(with_new_tokens(samples[4:8], new_ids),
                                                                                 4, PAD)]
    runs = {"new_ids": new_ids, "new_token_samples": with_new_tokens(samples[:8], new_ids),
            "adapter": tmp_path_factory.mktemp("embeddings") / "adapter",
            "tied_adapter": tmp_path_factory.mktemp("tied") / "adapter"}
    qwen = build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2") / "tiny-qwen2", family="qwen2")
    tied = tiny_config(qwen, model={"add_tokens": NEW_TOKENS[:1]}, lora={"train_embeddings": True})
    for world_size, data in ((1, whole), (2, per_rank)):
        embedding_data = [with_new[0] + with_new[1]] if world_size == 1 else with_new
        calls = {"loraplus": (loraplus_step, (loraplus, data)), "neftune": (neftune_against_transformers,
                                                                             (neftune, per_rank)),
                 "embeddings": (embeddings_step, (embeddings, embedding_data, runs["adapter"]))}
        if world_size == 1:
            calls["tied"] = (tied_embeddings_saved, (tied, runs["tied_adapter"]))
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
    # per tensor, bitsandbytes' step differs from the hand-computed one by its 8-bit state's rounding (tensors
    # of 4,096 elements or more) and where it adds eps (1.6e-4 seen); a wrong rate is 0.5 away
    assert relative_difference(run["delta"], expected) <= 1e-3
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


def peft_modules_to_save_grads(model_dir, run, samples) -> dict[str, torch.Tensor]:
    """PEFT's gradients with the embeddings and the head in modules_to_save, on transformers + bitsandbytes NF4 grown
    to the new vocabulary, their rows and the LoRA matrices set as ours started: the summed loss over the samples'
    targets divided by their count, as our step normalizes it."""
    model = transformers_nf4(model_dir)
    rows = run["before"]["base_model.model.model.embed_tokens.weight"]
    model.resize_token_embeddings(rows.shape[0])
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(rows)
        model.get_output_embeddings().weight.copy_(run["before"]["base_model.model.lm_head.weight"])
    model = get_peft_model(model, PeftLoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0,
                                                 modules_to_save=["embed_tokens", "lm_head"]))
    set_adapter(model)
    model.train()
    n_targets = sum(sum(label != IGNORE_INDEX for label in s.labels[1:]) for s in samples)
    for sample in samples:
        logits = model(input_ids=torch.tensor([sample.input_ids])).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(sample.labels[1:]), ignore_index=IGNORE_INDEX,
                                                 reduction="sum")
        (loss / n_targets).backward()
    return {name.replace("modules_to_save.default.", ""): p.grad for name, p in model.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize("world_size", [1, 2])
def test_embeddings_trained_beside_lora_equal_peft_modules_to_save(option_runs, tiny_model_dir, world_size):
    """Two new tokens grow the embeddings and the head by two rows, each the mean of the stored ones; every gradient
    (LoRA, embeddings, head) equals PEFT's with modules_to_save; one step moves them at lora.embeddings_lr with
    32-bit state (LoRA at optim.lr, 8-bit AdamW's first step by hand)."""
    run = option_runs[world_size]["embeddings"]
    embed = run["before"]["base_model.model.model.embed_tokens.weight"]
    assert embed.shape[0] == 514 and option_runs["new_ids"] == [512, 513]
    torch.testing.assert_close(embed[512], embed[:512].mean(0))
    theirs = peft_modules_to_save_grads(tiny_model_dir, run, option_runs["new_token_samples"])
    ours = {clean_name(name): grad for name, grad in run["grads"].items()}
    assert ours.keys() == theirs.keys()
    assert relative_difference(ours, theirs) <= 1e-5
    assert ours["base_model.model.model.embed_tokens.weight"][512:].abs().sum() > 0  # the new rows learn
    assert run["lrs"] == [LR, EMBEDDINGS_LR] and run["state_dtypes"] == {"torch.float32"}
    expected = {name: -(EMBEDDINGS_LR if "embed_tokens" in name or "lm_head" in name else LR)
                * grad / (grad.abs() + 1e-8) for name, grad in ours.items()}
    # per tensor: where bitsandbytes adds eps moves the smallest gradients' steps (2.6e-5 seen)
    assert relative_difference(run["delta"], expected) <= 1e-3
    if world_size == 2:
        assert relative_difference(run["grads"], option_runs[1]["embeddings"]["grads"]) <= 1e-5


def test_the_trained_embeddings_adapter_merges_to_the_live_models_logits(option_runs, tmp_path):
    """The saved adapter (modules_to_save: embed_tokens, lm_head; the tokenizer with its new tokens) merged: a plain
    transformers checkpoint of 514 tokens whose logits are the live model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qlora_fsdp.commands.merge import main as merge_main

    adapter = option_runs["adapter"]  # written last by the two ranks
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["embed_tokens", "lm_head"]
    merged = command_here(merge_main, ["--adapter", adapter, "--out", tmp_path / "merged", "--dtype", "float32"])
    assert merged.returncode == 0, merged.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert model.config.vocab_size == 514 and len(AutoTokenizer.from_pretrained(tmp_path / "merged")) == 514
    probe = option_runs[2]["embeddings"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(option_runs["new_token_samples"][0].input_ids)[None]).logits
    assert relative_difference({"l": logits[0]}, {"l": probe["logits"][0, : logits.shape[1]]}) <= 1e-4


def test_a_tied_head_trains_as_one_tensor_saved_under_both_names_and_merges(option_runs, tmp_path):
    """Qwen2's tied head and embeddings: one trained tensor, saved as both modules_to_save; the merge writes it once
    (the checkpoint stores the tied head under the embeddings' name) and gives the live logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from qlora_fsdp.commands.merge import main as merge_main

    run, adapter = option_runs[1]["tied"], option_runs["tied_adapter"]
    assert run["tensors"] == 1
    saved = load_file(adapter / "adapter_model.safetensors")
    embed, head = saved["base_model.model.model.embed_tokens.weight"], saved["base_model.model.lm_head.weight"]
    assert embed.shape[0] == 513 and torch.equal(embed, head)
    merged = command_here(merge_main, ["--adapter", adapter, "--out", tmp_path / "merged", "--dtype", "float32"])
    assert merged.returncode == 0, merged.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=run["ids"]).logits[0]
    assert relative_difference({"l": logits}, {"l": run["logits"]}) <= 1e-4
