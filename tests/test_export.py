"""The exported adapter is plain PEFT: transformers + PEFT alone load it and reproduce the trained loss."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from qlora_fsdp.api import train
from qlora_fsdp.data.pipeline import load_dataset
from tests.helpers import run_ranks_sequence, tiny_config

pytestmark = pytest.mark.slow  # every test trains on gloo ranks


def train_briefly(info, cfg):
    return train(cfg, info=info)


def peer_eval_loss(model_dir, adapter_dir, cfg) -> float:
    """Held-out loss of base + adapter loaded the way a PEFT user would, none of our loading code."""
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, dtype=torch.bfloat16)
    for module in base.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False  # same CPU kernel as training (DESIGN.md, CPU eval trap)
    with warnings.catch_warnings():
        # PEFT only warns when adapter keys are missing: make that a failure
        warnings.filterwarnings("error", message=".*missing adapter keys.*")
        model = PeftModel.from_pretrained(base, adapter_dir)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    data = load_dataset(tokenizer, cfg.data, cfg.train.seed)
    eval_samples = data.samples(data.eval, list(range(len(data.eval))))
    total, n_targets = 0.0, 0
    with torch.no_grad():
        for sample in eval_samples:
            ids = torch.tensor([sample.input_ids])
            logits = model(input_ids=ids).logits[0, :-1].float()
            targets = torch.tensor(sample.labels[1:])
            total += torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()
            n_targets += int((targets != -100).sum())
    return total / n_targets


@pytest.fixture(scope="module")
def trained_runs(tiny_model_dir, tmp_path_factory):
    """Two short 2-rank runs, LoRA and DoRA, in one start-up of the ranks: {use_dora: (cfg, summary)}."""
    root = tmp_path_factory.mktemp("export")
    cfgs = {dora: tiny_config(tiny_model_dir, model={"dtype": "bfloat16"}, quant={"compute_dtype": "bfloat16"},
                              lora={"use_dora": dora}, optim={"lr": 3e-3},
                              train={"max_steps": 8, "output_dir": str(root / f"dora_{dora}")},
                              data={"micro_batch_size": 4, "grad_accum_steps": 1, "eval_samples": 32})
            for dora in (False, True)}
    summaries = run_ranks_sequence([(train_briefly, (cfg,)) for cfg in cfgs.values()], 2, root)
    return {dora: (cfg, summary) for (dora, cfg), summary in zip(cfgs.items(), summaries, strict=True)}


@pytest.mark.parametrize("use_dora", [False, True])
def test_exported_adapter_reproduces_trained_loss(tiny_model_dir, trained_runs, use_dora):
    cfg, summary = trained_runs[use_dora]
    adapter = Path(cfg.train.output_dir) / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == cfg.lora.r and config["use_dora"] == use_dora
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "tokenizer.json").is_file()

    trained = summary["eval_loss_end"]
    assert trained < summary["eval_loss_start"] - 0.1  # the adapter learned something worth reproducing
    reproduced = peer_eval_loss(tiny_model_dir, adapter, cfg)
    assert abs(reproduced - trained) / trained < 2e-3, (reproduced, trained)
