"""Run the bad-input corpus (tests/test_bad_inputs.py) and print docs/troubleshooting.md, or write it. About 20 s on
2 cores: every case is run in-process, as its test runs it, against a tiny checkpoint built in a temporary folder.

    python scripts/error_reference.py            # print it
    python scripts/error_reference.py --write    # write docs/troubleshooting.md
"""

import argparse
import importlib
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the corpus never needs the network
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is a folder of the checkout, not the package

if __name__ == "__main__":
    # imported by name: `make lint` type-checks scripts/, and tests/ (torch's and bnb's untyped corners) is not linted
    reference = importlib.import_module("tests.error_reference")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write docs/troubleshooting.md")
    args = parser.parse_args()
    page = reference.render(reference.run_all())
    if args.write:
        reference.PAGE.write_text(page)
    else:
        print(page, end="")
