"""`python scripts/merge_adapter.py --adapter A --out OUT`: merge an adapter into its base (qlora_fsdp.commands.merge,
or qlora-merge; --help lists the options)."""

import sys

from qlora_fsdp.commands.merge import main

if __name__ == "__main__":
    sys.exit(main())
