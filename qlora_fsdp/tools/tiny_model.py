"""The embedded default model: a tiny causal LM with seeded random weights and a locally trained tokenizer.

Saved as a standard Hugging Face checkpoint folder (config.json, model.safetensors, tokenizer files), so it goes
through exactly the loading code a real 70B checkpoint does. Nothing is downloaded. `scripts/make_tiny_model.py`
(`make tiny-model`), the tests and `make gpu-check` all build it here, so they build the same model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from qlora_fsdp.families import small_models_tie_embeddings

SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shapes and seeds of a tiny model; the defaults are `make tiny-model`'s."""

    hidden_size: int = 128
    layers: int = 4
    family: str = "llama"
    seed: int = 0
    # 0.1, not the usual 0.02: with frozen random embeddings and head, a 0.02 head caps the logits near
    # +-2.5, so no adapter could make confident predictions and the demo loss could barely fall
    init_std: float = 0.1
    vocab_size: int = 512
    intermediate_size: int | None = None  # None: twice the hidden size
    attention_heads: int = 4
    kv_heads: int = 2
    max_positions: int = 1024


def corpus(dataset: Path) -> Iterator[str]:
    with dataset.open() as f:
        for line in f:
            record = json.loads(line)
            yield " ".join(str(v) for v in record.values())
    # the prompt template's fixed words, so they become single tokens
    yield "### Instruction:\n### Input:\n### Response:\n" * 50


def train_tokenizer(dataset: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown text
    )
    tok.train_from_iterator(corpus(dataset), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec) -> PreTrainedModel:
    """A tiny causal LM of the chosen family, same shapes for all: GQA attention, SwiGLU MLP."""
    if spec.family not in FAMILIES:
        raise ValueError(f"unknown family {spec.family!r}; one of {', '.join(FAMILIES)}")
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size or spec.hidden_size * 2,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.attention_heads,
        num_key_value_heads=spec.kv_heads,  # grouped-query attention, as in Llama 3
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.init_std,
        # Qwen's small models tie the head to the embeddings; cover that path too
        tie_word_embeddings=small_models_tie_embeddings(spec.family),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = AutoConfig.for_model(spec.family, **common)
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


def write_tiny_model(out: Path, dataset: Path, spec: TinyModelSpec,
                     max_shard_size: str = "50GB") -> PreTrainedModel:
    """Train the tokenizer on `dataset`, build the model, save both to `out` (seconds on a CPU)."""
    tokenizer = train_tokenizer(dataset, spec.vocab_size)
    model = build_tiny_model(tokenizer, spec)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    return model
