"""An example tool and environment for GRPO's multi-turn rollouts (docs/grpo.md, "Tools and environments").

    grpo:
      tools: [examples/agent_tools.py:calculate]
      environment: examples/agent_tools.py:make_counter
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

OPERATORS: dict[type[ast.AST], Callable[..., float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow, ast.USub: operator.neg}


def evaluated(node: ast.AST) -> float:
    """Arithmetic only: numbers and + - * / **, never names or calls (the model writes the expression)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluated(node.left), evaluated(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluated(node.operand))
    raise ValueError("only numbers and + - * / ** are allowed")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers and + - * / ** with parentheses, e.g. "(3 + 4) * 2".
    """
    return f"{evaluated(ast.parse(expression, mode='eval').body):g}"


class Counter:
    """A counter the model moves toward the record's `target`; the reward is 1 on the target, less the further."""

    def __init__(self) -> None:
        self.position, self.target = 0, 0

    def reset(self, **record: Any) -> str:
        self.position, self.target = 0, int(record.get("target", 10))
        return f" The counter is at 0; bring it to {self.target}."

    def move(self, steps: int) -> str:
        """Move the counter.

        Args:
            steps: How far to move it (negative moves back).
        """
        if abs(steps) > 100:
            raise ValueError("at most 100 steps at a time")
        self.position += steps
        return f"The counter is at {self.position}."

    def get_reward(self) -> float:
        return 1.0 / (1.0 + abs(self.position - self.target))


def make_counter() -> Counter:
    return Counter()
