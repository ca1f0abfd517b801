"""KTO on the 4-bit, sharded model: its loss and LoRA gradients equal TRL 1.16's KTOTrainer (its collator, KL
estimate and loss on transformers + bitsandbytes NF4 with the same adapter) on the same records; k micro-batches
equal one batch and two ranks equal one; the records are read, rotated and labelled as TRL's shape says."""

from __future__ import annotations

import json

import pytest
import torch

from qlora_fsdp.data.batching import collate_packed
from qlora_fsdp.data.pair_pipeline import load_pairs
from qlora_fsdp.data.pipeline import Dataset
from qlora_fsdp.errors import DataError
from qlora_fsdp.labels import IGNORE_INDEX
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.loading.placement import copy_full_into
from qlora_fsdp.objectives.pair_steps import accumulate_pairs, pair_rows
from tests.helpers import (
    REPO,
    full_grads,
    rank_units,
    recipe_pair_loss,
    relative_difference,
    run_ranks_sequence,
    split_parts,
    tiny_config,
    transformers_nf4,
)
from tests.test_preference_training import nudge_adapter


def set_adapter(model) -> None:
    """Every LoRA matrix set to a fixed pattern (A as well as B: PEFT draws its A matrices otherwise than we do)."""
    nudge_adapter(model)
    for name, parameter in model.named_parameters():
        if "lora_A" in name:
            copy_full_into(parameter, -0.1 * torch.cos(torch.arange(parameter.numel(), dtype=torch.float32)).view(
                parameter.shape))

pytestmark = pytest.mark.slow  # gloo ranks

KTO_DATA = str(REPO / "data" / "tiny_kto.jsonl")
N_RECORDS = 8


def kto_config(model_dir, fsdp=None, **preference):
    cfg = tiny_config(model_dir, data={"path": KTO_DATA, "format": "chat", "context_length": 128, "eval_samples": 8},
                      train={"objective": "kto"}, preference={"desirable_weight": 1.0, "undesirable_weight": 1.5,
                                                              **preference}, fsdp=fsdp or {})
    cfg.lora.dropout = 0.0
    return cfg


def kto_records(cfg):
    """The first training records as pairs (own sequence, KL sequence) and their labels."""
    data = load_pairs(load_tokenizer(cfg), cfg)
    ids = list(range(N_RECORDS))
    return pair_rows(data.samples(data.train, ids)), [Dataset.pair_extras(data.train)["desirable"][i] for i in ids]


def kto_step(info, cfg, per_batch: int):
    """One accumulated step over this rank's share of the first records (the adapter set off zero)."""
    torch.manual_seed(0)
    model = build_sharded_model(cfg, info)
    set_adapter(model)
    rows, labels = kto_records(cfg)
    mine, pad_id = rank_units(N_RECORDS, cfg, info.rank, info.world_size), load_tokenizer(cfg).pad_token_id
    batches = []
    for start in range(0, len(mine), per_batch):
        ids = mine[start : start + per_batch]
        batch = collate_packed([rows[i] for i in ids], pad_id)
        batch.desirable = torch.tensor([labels[i] for i in ids])
        batches.append(batch)
    batches = split_parts(batches, cfg, info.rank, pad_id)
    result = accumulate_pairs(model, batches, info.device, recipe_pair_loss(cfg, info.device))
    return {"loss": result.loss, "metrics": result.metrics, "grads": full_grads(model)}


def target_span(sample) -> tuple[int, int]:
    """Where a sequence's target tokens start and end."""
    targets = [i for i, label in enumerate(sample.labels) if label != IGNORE_INDEX]
    assert targets == list(range(targets[0], targets[-1] + 1)), "one run of targets"
    return targets[0], targets[-1] + 1


def trl_kto_step(model_dir, cfg) -> dict:
    """TRL's KTOTrainer on the same records' tokens: its collator, its KL estimate over the batch and its loss, on
    transformers + bitsandbytes NF4 with the same LoRA adapter (set alike), the reference its adapter off."""
    import datasets
    from peft import LoraConfig
    from trl import KTOConfig, KTOTrainer

    tokenizer = load_tokenizer(cfg)
    rows, labels = kto_records(cfg)
    examples = []
    for (own, kl), label in zip(rows, labels, strict=True):
        start, own_end, kl_end = (target_span(own)[0], target_span(own)[1], target_span(kl)[1])
        assert own.input_ids[:start] == kl.input_ids[:start] and target_span(kl)[0] == start  # one prompt
        # TRL's targets are every token after the prompt: the template's tail after the reply is left out
        examples.append({"prompt_ids": own.input_ids[:start], "completion_ids": own.input_ids[start:own_end],
                         "KL_completion_ids": kl.input_ids[start:kl_end], "label": label})
    tiny = datasets.Dataset.from_list([{"prompt": "a", "completion": "b", "label": True}] * 2)
    args = KTOConfig(output_dir=str(REPO / "outputs" / "trl_kto_test"), beta=0.1, desirable_weight=1.0,
                     undesirable_weight=1.5, per_device_train_batch_size=N_RECORDS, gradient_checkpointing=False,
                     report_to=[], max_length=None, bf16=False, use_cpu=True)
    # TRL adds the adapter itself, so that its reference is the base with the adapter off (given a PEFT model, its
    # reference would be a frozen copy of that adapter)
    peft_config = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, target_modules="all-linear", lora_dropout=0.0)
    trainer = KTOTrainer(model=transformers_nf4(model_dir), args=args, train_dataset=tiny, processing_class=tokenizer,
                         peft_config=peft_config)
    model = trainer.model
    for name, param in model.named_parameters():  # TRL makes a 4-bit model's adapter bf16; ours trains in fp32
        if "lora_" in name:
            param.data = param.data.float()
    set_adapter(model)
    model.train()
    loss = trainer._compute_loss(model, trainer.data_collator(examples), False)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return {"loss": loss.item(), "kl": trainer._metrics["train"]["kl"][-1], "grads": grads}


@pytest.fixture(scope="module")
def kto_runs(tiny_model_dir, tmp_path_factory):
    cfg = kto_config(tiny_model_dir)
    one, accumulated = run_ranks_sequence([(kto_step, (cfg, N_RECORDS)), (kto_step, (cfg, 2))], 1,
                                          tmp_path_factory.mktemp("kto1"))
    sharded, split = run_ranks_sequence([(kto_step, (cfg, 2)), (kto_step, (kto_config(tiny_model_dir, fsdp={
        "context_parallel": 2}), 2))], 2, tmp_path_factory.mktemp("kto2"))
    return {"cfg": cfg, "one": one, "accumulated": accumulated, "sharded": sharded, "split": split}


def test_kto_equals_trls_kto_trainer_and_accumulates_and_shards_exactly(tiny_model_dir, kto_runs):
    """Loss, z0 and every LoRA gradient against TRL's on the same 8 records (one batch, z0 over it); then 4
    micro-batches of 2, two ranks, and rows split over two ranks (context parallel) against one batch."""
    trl = trl_kto_step(tiny_model_dir, kto_runs["cfg"])
    one = kto_runs["one"]
    assert trl["kl"] > 1e-4  # the nudged adapter moved the policy off the reference: z0 is not clamped to 0
    assert one["metrics"]["kl"] == pytest.approx(trl["kl"], rel=1e-5)
    assert one["loss"] == pytest.approx(trl["loss"], rel=1e-5)
    ours = {name.replace("_checkpoint_wrapped_module.", ""): grad for name, grad in one["grads"].items()}
    assert ours.keys() == trl["grads"].keys()
    assert relative_difference(ours, trl["grads"]) <= 1e-5
    for other in ("accumulated", "sharded", "split"):
        run = kto_runs[other]
        assert run["loss"] == pytest.approx(one["loss"], rel=1e-5), other
        assert relative_difference(run["grads"], one["grads"]) <= 1e-5, other
        for key, value in one["metrics"].items():
            assert run["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (other, key)


def test_kto_records_pair_each_prompt_with_the_previous_completion(tiny_model_dir, tmp_path):
    """TRL's unpaired shape (strings or messages, a boolean label): each record's KL sequence is its prompt with the
    previous usable record's completion, the first taking the last's; a bad record names its file and line."""
    path = tmp_path / "kto.jsonl"
    records = [{"prompt": "Say one.", "completion": "One.", "label": True},
               {"prompt": [{"role": "user", "content": "Say two."}],
                "completion": [{"role": "assistant", "content": "Two."}], "label": False},
               {"prompt": "Say three.", "completion": "Three.", "label": 1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:1] + records[2:]))
    cfg = kto_config(tiny_model_dir)
    cfg.data.path, cfg.data.eval_samples = str(path), 0
    tokenizer = load_tokenizer(cfg)
    data = load_pairs(tokenizer, cfg)
    texts = [tokenizer.decode(s.input_ids) for s in data.samples(data.train, list(range(len(data.train))))]
    own = {t.split("Say ")[1].split(".")[0]: t for t in texts[0::2]}
    kl = {t.split("Say ")[1].split(".")[0]: t for t in texts[1::2]}
    assert "One." in own["one"] and "Three." in own["three"]
    assert "Three." in kl["one"] and "One." in kl["three"]
    assert sorted(Dataset.pair_extras(data.train)["desirable"]) == [True, True]
    path.write_text(json.dumps(records[0]) + "\n" + json.dumps({**records[1], "label": "yes"}) + "\n")
    with pytest.raises(DataError, match=r"kto.jsonl: record 2: its label is 'yes'"):
        load_pairs(tokenizer, cfg)
