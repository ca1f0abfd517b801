"""Benchmarks, each printing a table (docs/benchmarks/ has every result and the command that made it).
Run from the checkout as modules: `python -m benchmarks.training_speed`, `python -m benchmarks.loading`, ...
Nothing here is fetched from a hub."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before any submodule imports transformers
