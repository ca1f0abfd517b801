"""Print a recipe's memory plan: per-GPU and host memory, FITS or DOES NOT FIT, and fixes for a misfit.

Same as `train.py --recipe R --plan`: no GPU, no weights, no download (the recipes' model configs ship in
model_configs/). Exit code 0 when it fits, 1 when it does not.

    qlora-plan --recipe llama70b_2x4090 [key=value ...]
    python scripts/plan.py --recipe llama70b_2x4090 [key=value ...]
"""

from __future__ import annotations

import sys

from qlora_fsdp.commands.train import main as train_main


def main(argv: list[str] | None = None) -> int:
    return train_main([*(sys.argv[1:] if argv is None else argv), "--plan"])


if __name__ == "__main__":
    sys.exit(main())
