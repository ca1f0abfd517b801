"""The command lines: train (train.py), plan, merge, generate and export (GGUF), installed as console entry points
(qlora-train, qlora-plan, qlora-merge, qlora-generate, qlora-export; pyproject.toml) and run from the checkout by
train.py and scripts/."""
