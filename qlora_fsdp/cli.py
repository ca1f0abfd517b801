"""Fine-tune a 4-bit base model with LoRA under FSDP2.

    torchrun --nproc_per_node 2 train.py --recipe tiny_cpu [key=value ...]
    python train.py --recipe tiny_cpu optim.lr=3e-4 data.micro_batch_size=4
    python train.py --recipe tiny_cpu --print-config
    torchrun --nproc_per_node 2 train.py --recipe tiny_cpu --resume    # continue from the latest checkpoint
"""

# train.py's command line (its docstring is the --help text). It lives in the package so that scripts/plan.py
# and tests/fault_run.py run the same code without importing train.py from outside the package.

from __future__ import annotations

import argparse

from qlora_fsdp.config import load_config, to_yaml
from qlora_fsdp.errors import run_command


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny_cpu", help="a name in recipes/ or a path to a YAML file")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--plan", action="store_true", help="print the memory plan (no GPU, no weights) and exit")
    parser.add_argument("--resume", nargs="?", const="auto", metavar="CHECKPOINT",
                        help="continue from the latest checkpoint in train.output_dir, or from CHECKPOINT")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=3e-4")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    return run_command(lambda: run(args))


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.resume and "=" in args.resume:  # `--resume optim.lr=1e-4`: an override, not a checkpoint
        overrides.insert(0, args.resume)
        args.resume = "auto"
    resume = [f"train.resume={args.resume}"] if args.resume else []
    cfg = load_config(args.recipe, [*overrides, *resume])
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    if args.plan:
        from qlora_fsdp.plan.memory import report

        text, fits = report(cfg)
        print(text)
        return 0 if fits else 1
    from qlora_fsdp.api import train  # heavy imports only once the config is known to be good
    from qlora_fsdp.distributed import cleanup

    try:
        train(cfg)
    finally:
        cleanup()
    return 0
