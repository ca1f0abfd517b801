"""`python scripts/plan.py --recipe R [key=value ...]`: the memory plan (qlora_fsdp.commands.plan, or qlora-plan)."""

import sys

from qlora_fsdp.commands.plan import main

if __name__ == "__main__":
    sys.exit(main())
