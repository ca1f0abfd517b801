"""Print the README's table of shipped recipes from their plans, or write it into the README (a build step: the
planned memory is written by the planner alone). A minute or two on 2 cores: every recipe is planned.

    python scripts/recipe_table.py            # print it
    python scripts/recipe_table.py --write    # replace the table in README.md
    python scripts/recipe_table.py --json     # each recipe's figures, row and report (what tests/test_plan.py reads)
"""

import argparse
import json

from qlora_fsdp.config import REPO_ROOT
from qlora_fsdp.plan.recipe_table import plan_alone, plan_summary, recipe_names, recipe_table, write_readme_table

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write it into README.md between its markers")
    parser.add_argument("--json", action="store_true", help="print every recipe's figures as JSON instead")
    args = parser.parse_args()
    plans = {name: plan_alone(name) for name in recipe_names()}
    if args.json:
        print(json.dumps({name: plan_summary(name, planned) for name, planned in plans.items()}))
    else:
        table = recipe_table(plans)
        if args.write:
            write_readme_table(REPO_ROOT / "README.md", table)
        print(table)
