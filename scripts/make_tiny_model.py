"""Build the embedded default model: a tiny Llama with seeded random weights and a locally trained tokenizer.

Saved as a standard Hugging Face checkpoint folder (config.json, model.safetensors, tokenizer files), so it
goes through exactly the loading code a real 70B checkpoint does. Nothing is downloaded. The builder lives in
qlora_fsdp.tools.tiny_model, shared with the tests and `make gpu-check`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qlora_fsdp.tools.tiny_model import FAMILIES, TinyModelSpec, write_tiny_model

DEFAULTS = TinyModelSpec()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("models/tiny-llama"))
    parser.add_argument("--dataset", type=Path, default=Path("data/tiny_instruct.jsonl"))
    parser.add_argument("--vocab-size", type=int, default=DEFAULTS.vocab_size)
    parser.add_argument("--hidden-size", type=int, default=DEFAULTS.hidden_size)
    parser.add_argument("--layers", type=int, default=DEFAULTS.layers)
    parser.add_argument("--family", choices=FAMILIES, default=DEFAULTS.family)
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--init-std", type=float, default=DEFAULTS.init_std,
                        help="weight init std (0.1: see TinyModelSpec for why not 0.02)")
    parser.add_argument("--max-shard-size", default="50GB", help="e.g. 200KB to write several shards")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    spec = TinyModelSpec(hidden_size=args.hidden_size, layers=args.layers, family=args.family, seed=args.seed,
                         init_std=args.init_std, vocab_size=args.vocab_size)
    model = write_tiny_model(args.out, args.dataset, spec, args.max_shard_size)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote a {n_params / 1e6:.2f}M-parameter {args.family} model and a {model.config.vocab_size}-token "
          f"tokenizer to {args.out}")


if __name__ == "__main__":
    main()
