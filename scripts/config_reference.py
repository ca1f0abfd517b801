"""Print docs/config-reference.md as the schema makes it, write it, or check that the committed page is current.

    python scripts/config_reference.py            # print it
    python scripts/config_reference.py --write    # write docs/config-reference.md
    python scripts/config_reference.py --check    # exit 1 (one line) when the page differs from the schema's
"""

import argparse
import sys

from qlora_fsdp.config.reference import PAGE, REGENERATE, render

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {PAGE.name}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the committed page is out of date")
    args = parser.parse_args()
    page = render()
    if args.write:
        PAGE.write_text(page)
    elif args.check:
        if not PAGE.is_file() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(PAGE.parents[1])} is out of date with the schema: run {REGENERATE}")
            sys.exit(1)
    else:
        print(page, end="")
