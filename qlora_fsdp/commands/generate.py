"""Sample from the 4-bit base + a trained adapter, with the prompt template training used.

    qlora-generate --adapter outputs/demo/adapter --prompt "Reverse the letters of the word." --input river
    python scripts/generate.py --adapter outputs/demo/adapter --prompt "Reverse the letters of the word." --input river
    python scripts/generate.py --adapter outputs/demo/adapter              # interactive: one prompt a line
    python scripts/generate.py --adapter ADAPTER --temperature 0.7 --top-p 0.9 --max-new-tokens 256
    python scripts/generate.py --recipe tiny_cpu --no-adapter --prompt ... # the base alone, to compare
    torchrun --nproc_per_node 2 scripts/generate.py --adapter ADAPTER      # sharded over 2 GPUs, as training was
    python scripts/generate.py --adapter ADAPTER --offload                 # one GPU, one layer at a time on it
    python scripts/generate.py --adapter ADAPTER --image cat.png --prompt "What is this?"  # a vision-language model

Settings (model, quantization, template, sharding) come from the adapter folder's training_config.yaml, or
--recipe. The model is held as training held it: FSDP2 over the torchrun ranks, with the recipe's
fsdp.cpu_offload; --offload / --no-offload override that. Only rank 0 reads prompts and prints replies.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

from qlora_fsdp.commands.exit import leave_process, run_command
from qlora_fsdp.config import load_config
from qlora_fsdp.errors import UserError


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", type=Path, help="a PEFT adapter folder written by train.py")
    parser.add_argument("--no-adapter", action="store_true", help="the base model alone (needs --recipe)")
    parser.add_argument("--recipe", help="settings, where the adapter has no training_config.yaml")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); none: read prompts from stdin")
    parser.add_argument("--input", default="", help="an alpaca-style input for every prompt (the record's `input`)")
    parser.add_argument("--system", help="a system message before each prompt")
    parser.add_argument("--image", action="append", type=Path,
                        help="an image shown with every prompt (repeatable; a vision-language checkpoint)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                        help="keep the 4-bit shards in host RAM, one layer at a time on the GPU (default: as the "
                        "recipe trained, fsdp.cpu_offload); slower, but a 70B fits one 24 GB GPU")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.path=/local/copy")
    return parser.parse_args(argv)


def prompts(args: argparse.Namespace) -> Iterator[str]:
    if args.prompt:
        yield from args.prompt
        return
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return
        if line.strip():
            yield line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: run(args))


def run(args: argparse.Namespace) -> int:
    from qlora_fsdp.loading.adapter import config_for_adapter  # PEFT and torch: not for --help or a usage error

    if args.no_adapter == (args.adapter is not None):
        raise UserError("give --adapter ADAPTER, or --no-adapter with --recipe")
    if args.no_adapter:
        if not args.recipe:
            raise UserError("--no-adapter needs --recipe to know the base model")
        cfg = load_config(args.recipe, args.overrides)
    else:
        cfg = config_for_adapter(args.adapter, args.recipe, args.overrides)
    from qlora_fsdp.data.sources import alpaca_user_turn
    from qlora_fsdp.distributed import cleanup
    from qlora_fsdp.tools.adapter_sampling import Sampling, load_generator  # heavy imports once the arguments are good

    try:
        generator = load_generator(cfg, args.adapter, args.offload, images=bool(args.image))
        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
        for prompt in shared_prompts(args):
            reply = generator.reply(alpaca_user_turn(prompt, args.input), sampling, args.system, args.image)
            if generator.is_main:
                print(reply, flush=True)
    finally:
        cleanup()
    return 0


def shared_prompts(args: argparse.Namespace) -> Iterator[str]:
    """Rank 0's prompts, handed to every rank (torchrun's ranks share one stdin, and all must run the same
    forwards); the others wait for each, at most train.collective_timeout_minutes."""
    from qlora_fsdp.distributed import decide_on_main

    mine = prompts(args)  # advanced on rank 0 only
    while (prompt := decide_on_main(lambda: next(mine, None))) is not None:
        yield prompt


def entry() -> None:
    """The console entry point (and scripts/generate.py)."""
    leave_process(main)
