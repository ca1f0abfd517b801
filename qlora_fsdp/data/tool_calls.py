"""Tool calls and tools: the dataset's JSON text -> what chat templates read.

Tool calls travel through the dataset as JSON text (Arrow needs one schema, and tool arguments differ from
record to record) and are parsed here into what chat templates read: assistant messages with OpenAI-shaped
`tool_calls`, `tool` messages for the results, and the function schemas passed as `tools=`.
"""

from __future__ import annotations

import json
from typing import Any

from qlora_fsdp.errors import DataError, first_line

Message = dict[str, Any]


def tool_calls_of(value: Any) -> list[dict[str, Any]]:
    """Tool calls in the usual shapes -> OpenAI's, arguments as an object; ValueError says what is wrong.

    Accepted: one call or a list, or either as JSON text; a call as {"type": "function", "function": {"name",
    "arguments"}} or bare {"name", "arguments"} (glaive); arguments an object or its JSON text."""
    if isinstance(value, str):
        value = json.loads(value)  # a JSONDecodeError is a ValueError
    return [one_tool_call(call) for call in (value if isinstance(value, list) else [value])]


def one_tool_call(call: Any) -> dict[str, Any]:
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"a tool call needs a function name: {call!r:.80}")
    arguments = function.get("arguments", function.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments must be a JSON object: {arguments!r:.80}")
    out: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str) and call["id"]:
        out["id"] = call["id"]
    return out


def tools_of(value: Any) -> list[dict[str, Any]]:
    """Function schemas (a list, or its JSON text; bare or OpenAI's {"type": "function", "function": ...})
    -> OpenAI-shaped tools, the shape chat templates expect. Nothing -> []. ValueError says what is wrong."""
    try:
        if isinstance(value, str):
            value = json.loads(value) if value.strip() else []
    except json.JSONDecodeError as err:
        raise ValueError(f"tools that are not valid JSON ({err.msg})") from None
    value = [value] if isinstance(value, dict) else (value or [])
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise ValueError(f"tools that are not a list of function schemas: {value!r:.80}")
    return [tool if "function" in tool else {"type": "function", "function": tool} for tool in value]


def parsed_tools(value: Any) -> list[dict[str, Any]]:
    try:
        return tools_of(value)
    except ValueError as err:
        raise DataError(f"a conversation has {err}") from None


def template_messages(messages: list[Message]) -> list[Message]:
    """Dataset messages -> what chat templates read: empty fields left out (Llama's template tests `'tool_calls'
    in message`), tool calls parsed, and call ids made up where the data has none (Mistral's require them)."""
    out: list[Message] = []
    unanswered: list[str] = []  # ids of the calls not yet answered by a tool message, in order
    n_calls = 0
    for message in messages:
        chat: Message = {"role": message["role"], "content": message.get("content") or ""}
        if message.get("reasoning_content"):
            chat["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            chat["tool_calls"] = parsed_tool_calls(message["tool_calls"])
            for call in chat["tool_calls"]:
                n_calls += 1
                call.setdefault("id", f"call{n_calls:05d}")  # 9 characters, as Mistral's templates require
                unanswered.append(call["id"])
        if message["role"] == "tool":
            call_id = message.get("tool_call_id") or (unanswered[0] if unanswered else "")
            unanswered = [i for i in unanswered if i != call_id]
            if call_id:
                chat["tool_call_id"] = call_id
        out.append(chat)
    return out


def parsed_tool_calls(value: Any) -> list[dict[str, Any]]:
    try:
        return tool_calls_of(value)
    except ValueError as err:
        raise DataError(f"a tool call is malformed: {first_line(err)}") from None


def has_tools(messages: list[Message], tools: list[dict[str, Any]]) -> bool:
    return bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
