"""The command lines: train (train.py), plan, merge and generate, installed as console entry points
(qlora-train, qlora-plan, qlora-merge, qlora-generate; pyproject.toml) and run from the checkout by train.py and
scripts/."""
