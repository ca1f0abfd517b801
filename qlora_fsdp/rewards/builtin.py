"""Built-in reward functions, called as TRL calls reward functions (keyword arguments; every dataset column among
them) and returning a float or None per completion.

- math_answer: 1.0 when the completion's final answer equals the record's `answer` (GSM8K's `#### 42`, a
  `\\boxed{42}`, or the bare answer), else 0.0; None where the record's answer has no final answer to compare.
- format: 1.0 when the completion is the tags in order, each once (`<think>...</think><answer>...</answer>` by
  default: options {tags: [think, answer]}), else 0.0.
- length_penalty: DAPO's soft overlong punishment on the completion's tokens: 0 up to max_length - soft_cache
  tokens, then falling linearly to -1 at max_length, -1 beyond (options {max_length, soft_cache}).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

RewardFunction = Callable[..., list[float | None]]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def completion_text(completion: Any) -> str:
    """A plain completion, or a conversational one (a list holding the assistant's message)."""
    if isinstance(completion, list):
        return "".join(str(message.get("content", "")) for message in completion  # a tool's result is not an answer
                       if isinstance(message, dict) and message.get("role", "assistant") == "assistant")
    return str(completion)


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth < 0:
            return text[begin:index]
    return None


def final_answer(text: str) -> str | None:
    """What a math answer ends with: the last \\boxed{}, else what follows the last `####`, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalized(answer: str) -> str | Fraction:
    """A number as an exact fraction (commas, $ and a trailing period dropped), other text without spaces."""
    cleaned = answer.strip().replace("$", "").replace(",", "").rstrip(".").strip()
    cleaned = re.sub(r"\\(?:text|mathrm)\{([^}]*)\}", r"\1", cleaned)
    frac = re.fullmatch(r"\\d?frac\{(-?\d+)\}\{(\d+)\}", cleaned)
    if frac:
        return Fraction(int(frac.group(1)), int(frac.group(2)))
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return re.sub(r"\s+", "", cleaned)


def math_answer(completions: list[Any], answer: list[Any], **_: Any) -> list[float | None]:
    scores: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        wanted = final_answer(str(gold))
        if wanted is None:
            scores.append(None)
            continue
        got = final_answer(completion_text(completion))
        scores.append(float(got is not None and normalized(got) == normalized(wanted)))
    return scores


def format_reward(tags: list[str] | None = None) -> RewardFunction:
    names = tags or ["think", "answer"]
    body = r"\s*".join(rf"<{re.escape(t)}>(?:(?!<{re.escape(t)}>).)*?</{re.escape(t)}>" for t in names)
    pattern = re.compile(rf"^\s*{body}\s*$", re.S)

    def format(completions: list[Any], **_: Any) -> list[float | None]:  # noqa: A001 (the metric's name)
        return [float(pattern.match(completion_text(c)) is not None) for c in completions]

    return format


def length_penalty(max_length: int, soft_cache: int) -> RewardFunction:
    if not 0 < soft_cache <= max_length:
        raise ValueError(f"length_penalty needs 0 < soft_cache <= max_length, got {soft_cache} and {max_length}")

    def length_penalty(completion_ids: list[list[int]], **_: Any) -> list[float | None]:
        free = max_length - soft_cache
        return [0.0 if len(ids) <= free else -1.0 if len(ids) > max_length else (free - len(ids)) / soft_cache
                for ids in completion_ids]

    return length_penalty


def builtin(name: str, options: dict[str, Any], max_completion_length: int) -> RewardFunction | None:
    """The built-in of that name with its options, or None where there is none of that name."""
    if name == "math_answer":
        return math_answer
    if name == "format":
        return format_reward(options.get("tags"))
    if name == "length_penalty":
        max_length = int(options.get("max_length", max_completion_length))
        return length_penalty(max_length, int(options.get("soft_cache", max(max_length // 4, 1))))
    return None


BUILTINS = ("math_answer", "format", "length_penalty")
