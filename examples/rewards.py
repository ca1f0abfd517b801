"""A reward function as a user writes one, for the tiny GRPO demo (recipes/tiny_cpu_grpo.yaml names it as
`examples.rewards:category_words`): called as TRL calls reward functions, with the dataset's `category` column as a
keyword argument, one float per completion."""

from __future__ import annotations

from typing import Any

WORDS = {"colors": {"yellow", "purple", "orange", "silver", "copper"},
         "animals": {"tiger", "dragon", "falcon", "rabbit"}}


def category_words(completions: list[str], category: list[str], **kwargs: Any) -> list[float]:
    """The share of the completion's words that belong to the prompt's category."""
    scores = []
    for completion, wanted in zip(completions, category, strict=True):
        words = completion.split()
        scores.append(sum(word in WORDS[wanted] for word in words) / max(len(words), 1))
    return scores
