"""The cache key of tokenization, computed without pickling the tokenizer.

`datasets.map` names its cache by hashing the map function, which holds the tokenizer: for Gemma 3's 262k-token
vocabulary that pickling took 11.8 s of CPU, on every rank at every start. Given a fingerprint, `map` hashes
nothing: ours is a sha256 of the input's fingerprint, the tokenizer as its backend serializes it (vocabulary,
merges, normalizer, pre- and post-processor), its chat template and special tokens, the map's settings, and the
source of the modules that encode (a change to them is a new key, as a change to the function's code was).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

DATA_DIR = Path(__file__).resolve().parent
ENCODING_MODULES = ("templates.py", "chat_turns.py", "tool_calls.py", "pipeline.py", "pair_encoding.py",
                    "pair_pipeline.py", "fingerprint.py")


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """Everything of a fast tokenizer that changes its ids; None for a slow one (then datasets hashes it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    template = getattr(tokenizer, "chat_template", None)
    return "\n".join([type(tokenizer).__name__, backend.to_str(), repr(template), repr(tokenizer.special_tokens_map),
                      repr(getattr(tokenizer, "add_bos_token", None)), repr(getattr(tokenizer, "add_eos_token", None))])


def map_fingerprint(previous: str, tokenizer: PreTrainedTokenizerBase, *settings: Any) -> str | None:
    """The fingerprint for `datasets.map(..., new_fingerprint=)` of a tokenizing map, or None (let datasets hash)."""
    identity = tokenizer_identity(tokenizer)
    if identity is None:
        return None
    digest = hashlib.sha256()
    for part in (previous, identity, repr(settings), *((DATA_DIR / name).read_text() for name in ENCODING_MODULES)):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]
