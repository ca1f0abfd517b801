"""Tools as TRL 1.16's GRPOTrainer(tools=...) takes them: plain functions whose type hints and Google-style
docstring make the schema the chat template shows (transformers' get_json_schema), called with the model's
arguments under a time limit. A tool never ends a run: what it raises, a hang, or an unknown name becomes the
tool's message (`{'error': ...}`, TRL's shape) and counts as a failed call."""

from __future__ import annotations

import asyncio
import inspect
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from qlora_fsdp.agents.user_code import import_function
from qlora_fsdp.errors import ConfigError, first_line


@dataclass(frozen=True)
class Tool:
    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]  # OpenAI-shaped: {"type": "function", "function": {name, description, parameters}}


def tool_of(function: Callable[..., Any], where: str) -> Tool:
    """The function as a tool, or a one-line ConfigError: no type hints, no docstring, an undocumented argument."""
    try:
        schema = get_json_schema(function)
    except Exception as error:  # noqa: BLE001 (transformers' TypeHint/DocstringParsingException and kin)
        raise ConfigError(f"{where}: {first_line(error)}; a tool needs type hints and a Google-style docstring "
                          "(Args: one line per argument)") from None
    return Tool(function.__name__, function, schema)


def load_tools(specs: list[str]) -> list[Tool]:
    tools = [tool_of(import_function(spec, "tool"), f"tool {spec!r}") for spec in specs]
    names = [tool.name for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"grpo.tools names {repeated} twice; the model calls a tool by its name")
    return tools


class ToolTimeout(BaseException):
    """The tool ran past its time (a BaseException, so a tool's own `except Exception` cannot swallow it)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """SIGALRM in the main thread (it interrupts Python code, a sleep included); elsewhere no limit can be set on
    a running call, and the caller runs the tool in a thread of its own instead."""
    def expired(signum: int, frame: Any) -> None:
        raise ToolTimeout(f"the tool ran past its {seconds:g} s (grpo.tool_timeout_s)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def in_a_thread(function: Callable[..., Any], arguments: dict[str, Any], seconds: float) -> Any:
    """The call in a daemon thread, waited for `seconds`: past them it is abandoned (it may still finish)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = function(**arguments)
        except BaseException as error:  # noqa: BLE001 (handed to the caller)
            box["error"] = error

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise ToolTimeout(f"the tool ran past its {seconds:g} s (grpo.tool_timeout_s)")
    if "error" in box:
        raise box["error"]
    return box["result"]


def call_with_time_limit(function: Callable[..., Any], arguments: dict[str, Any], seconds: float) -> Any:
    """The call's result within `seconds`; an async tool (TRL takes them) is run to its end on an event loop of
    its own, under the same limit."""
    if inspect.iscoroutinefunction(function):
        coroutine = function
        function = lambda **kw: asyncio.run(coroutine(**kw))  # noqa: E731 (the same call, awaited)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        with time_limit(seconds):
            return function(**arguments)
    return in_a_thread(function, arguments, seconds)


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: Any  # the tool's return value as text, or a list of content parts (TRL passes lists through)
    failed: bool


def run_call(tools: dict[str, Callable[..., Any]], call: dict[str, Any], seconds: float) -> ToolResult:
    """One of the model's calls ({"type": "function", "function": {"name", "arguments"}}) run: the result, or the
    failure as the tool's message, as TRL writes both."""
    function = call.get("function", {})
    name = str(function.get("name", "unknown"))
    if call.get("type") != "function":
        return ToolResult(name, str({"error": f"Unsupported tool call type: {call.get('type')}"}), True)
    try:
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        result = call_with_time_limit(tools[name], dict(function.get("arguments") or {}), seconds)
    except (Exception, ToolTimeout) as error:  # noqa: BLE001 (a tool never ends the run)
        return ToolResult(name, str({"error": str(error)}), True)
    return ToolResult(name, result if isinstance(result, list) else str(result), False)
