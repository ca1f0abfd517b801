"""The recipe's dtype names and torch's dtypes, in one table."""

from __future__ import annotations

import torch

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
