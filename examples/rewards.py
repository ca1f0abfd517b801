"""Reward functions as a user writes them, for the GRPO demos (recipes name them as `examples.rewards:NAME`):
called as TRL calls reward functions, with the dataset's columns as keyword arguments, one float per completion."""

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


def correct_tool_call(completions: list[list[dict[str, Any]]], answer: list[str], **kwargs: Any) -> list[float]:
    """1 when a tool's result in the conversation is the record's answer: the model called the calculator on the
    right expression (make demo-tools); multi-turn completions are conversations, as TRL passes them."""
    return [float(any(message.get("role") == "tool" and str(message.get("content", "")).strip() == wanted.strip()
                      for message in conversation))
            for conversation, wanted in zip(completions, answer, strict=True)]
