"""Sampling from the 4-bit base + adapter, with the prompt rendered by the template the run trained with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from qlora_fsdp.config import Config, Template
from qlora_fsdp.data.pipeline import run_template
from qlora_fsdp.data.templates import prompt_ids
from qlora_fsdp.distributed import init_distributed
from qlora_fsdp.model.adapter import load_adapter_into
from qlora_fsdp.model.build import load_tokenizer
from qlora_fsdp.model.factory import build_model


@dataclass
class Sampling:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Generator:
    model: peft.PeftModel
    tokenizer: PreTrainedTokenizerBase
    template: Template
    device: torch.device

    @torch.no_grad()
    def reply(self, prompt: str, sampling: Sampling, system: str | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = torch.tensor([prompt_ids(messages, self.tokenizer, self.template)], device=self.device)
        torch.manual_seed(sampling.seed)
        sample = sampling.temperature > 0
        out = self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=sampling.max_new_tokens,
            do_sample=sample, temperature=sampling.temperature if sample else None,
            top_p=sampling.top_p if sample else None, pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id)
        text = self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert isinstance(text, str), "one sequence of ids decodes to one string"
        return text


def load_generator(cfg: Config, adapter_dir: Path | None) -> Generator:
    """The recipe's base in 4-bit on this machine's device (one process), with the adapter's weights; without
    an adapter, LoRA stays at its zero init, so replies are the base model's."""
    info = init_distributed()
    no_recompute = dataclasses.replace(cfg.activation_checkpointing, mode="off")  # no backward pass to save for
    model = build_model(dataclasses.replace(cfg, activation_checkpointing=no_recompute), info, shard=False)
    tokenizer = load_tokenizer(cfg)
    if adapter_dir is not None:
        load_adapter_into(model, adapter_dir)
        if (adapter_dir / "tokenizer_config.json").is_file():  # the tokenizer the run used, saved with it
            tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    model.eval()
    template = run_template(cfg.data, tokenizer)
    return Generator(model, tokenizer, template, info.device)
