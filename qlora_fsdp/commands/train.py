"""Fine-tune a 4-bit base model with LoRA under FSDP2.

    torchrun --nproc_per_node 2 train.py --recipe tiny_cpu [key=value ...]
    torchrun --nproc_per_node 2 -m qlora_fsdp.commands.train --recipe tiny_cpu    # the same, installed
    qlora-train --recipe tiny_cpu                                                    # one process
    python train.py --recipe tiny_cpu optim.lr=3e-4 data.micro_batch_size=4
    python train.py --recipe tiny_cpu --print-config
    torchrun --nproc_per_node 2 train.py --recipe tiny_cpu --resume    # continue from the latest checkpoint
    torchrun --nproc_per_node 2 train.py --recipe tiny_cpu --resume-from outputs/x/checkpoints/step-000200
    torchrun --nproc_per_node 2 train.py --resume train.output_dir=outputs/x    # the command in outputs/x/run.json
"""

# train.py's command line (its docstring is the --help text), in the package so that the plan command, the
# console entry point and tests/fault_run.py run the same code.

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qlora_fsdp.commands.exit import leave_process, run_command
from qlora_fsdp.config import last_override, load_config, merged_overrides, to_yaml
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.outputs.run_card import RUN_CARD, read_run_card

DEFAULT_RECIPE = "tiny_cpu"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", help=f"a name in recipes/ or a path to a YAML file (default {DEFAULT_RECIPE}; "
                        f"resuming a run folder, the one its {RUN_CARD} names)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--plan", action="store_true", help="print the memory plan (no GPU, no weights) and exit")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint in train.output_dir (train.resume=auto)")
    resume.add_argument("--resume-from", metavar="CHECKPOINT", help="continue from this checkpoint folder")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=3e-4")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: run(args))


def run(args: argparse.Namespace) -> int:
    for item in args.overrides:
        if "=" not in item and ("/" in item or Path(item).is_dir()):  # `--resume PATH`: the old spelling
            raise ConfigError(f"'{item}' is not a key=value override; to resume from a checkpoint folder, pass "
                              f"--resume-from {item}")
    resume = "auto" if args.resume else args.resume_from
    recipe, overrides = recipe_and_overrides(args)
    cfg = load_config(recipe, [*overrides, *([f"train.resume={resume}"] if resume else [])])
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    if args.plan:
        from qlora_fsdp.plan.report import report

        text, fits = report(cfg)
        print(text)
        return 0 if fits else 1
    from qlora_fsdp.api import train  # heavy imports only once the config is known to be good
    from qlora_fsdp.distributed import cleanup

    train(cfg, command=(recipe, overrides))
    cleanup()  # on error, run_command closes the group (after telling the other ranks)
    return 0


def recipe_and_overrides(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The recipe and overrides as given; resuming a run folder without --recipe, the command its run card holds
    (the overrides given now win over its own)."""
    if args.recipe is not None:
        return args.recipe, list(args.overrides)
    named = last_override(args.overrides, "train.output_dir")
    folder = (Path(args.resume_from).parent.parent if args.resume_from
              else Path(named) if args.resume and named else None)
    card = read_run_card(folder) if folder is not None else None
    if card is None:
        return DEFAULT_RECIPE, list(args.overrides)
    print(f"resuming {folder}: --recipe {card.recipe} and its overrides, from its {RUN_CARD}", flush=True)
    started = [item for item in card.overrides if not item.startswith("train.resume=")]
    return card.recipe, merged_overrides(started, list(args.overrides))


def entry() -> None:
    """The console entry point (and train.py)."""
    leave_process(main)


if __name__ == "__main__":
    entry()
