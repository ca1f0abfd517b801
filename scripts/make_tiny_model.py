"""Build the embedded default model: a tiny Llama with seeded random weights and a locally trained tokenizer.

Saved as a standard Hugging Face checkpoint folder (config.json, model.safetensors, tokenizer files), so it
goes through exactly the loading code a real 70B checkpoint does. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


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


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def build_model(tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> PreTrainedModel:
    """A tiny causal LM of the chosen family, same shapes for all: GQA attention, SwiGLU MLP."""
    family = getattr(args, "family", "llama")
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as in Llama 3
        max_position_embeddings=1024,
        initializer_range=args.init_std,
        # Qwen's small models tie the head to the embeddings; cover that path too
        tie_word_embeddings=family.startswith("qwen"),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = AutoConfig.for_model(family, **common)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("models/tiny-llama"))
    parser.add_argument("--dataset", type=Path, default=Path("data/tiny_instruct.jsonl"))
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    # 0.1, not the usual 0.02: with frozen random embeddings and head, a 0.02 head caps the logits near
    # +-2.5, so no adapter could make confident predictions and the demo loss could barely fall
    parser.add_argument("--init-std", type=float, default=0.1)
    parser.add_argument("--max-shard-size", default="50GB", help="e.g. 200KB to write several shards")
    args = parser.parse_args()
    tokenizer = train_tokenizer(args.dataset, args.vocab_size)
    model = build_model(tokenizer, args)
    model.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    tokenizer.save_pretrained(args.out)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote a {n_params / 1e6:.2f}M-parameter {args.family} model and a {len(tokenizer)}-token tokenizer "
          f"to {args.out}")


if __name__ == "__main__":
    main()
