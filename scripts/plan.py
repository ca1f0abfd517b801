"""Print a recipe's memory plan: per-GPU and host memory, FITS or DOES NOT FIT, and fixes for a misfit.

Same as `python train.py --recipe R --plan`: no GPU, no weights, no download (the recipes' model configs ship
in model_configs/). Exit code 0 when it fits, 1 when it does not.

    python scripts/plan.py --recipe llama70b_2x4090 [key=value ...]
"""

from __future__ import annotations

import sys

from qlora_fsdp.cli import main

if __name__ == "__main__":
    sys.exit(main([*sys.argv[1:], "--plan"]))
