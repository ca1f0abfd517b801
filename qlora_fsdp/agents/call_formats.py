"""The model's tool calls read out of its reply, in the format its chat template writes them.

The format is learnt from the template itself (a probe call rendered: what it writes around the call), so any
template in one of these families works, not only a list of known ones:
- hermes: Qwen 2.5/3, Hermes and our chatml: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- llama3: Llama 3.1-3.3: the reply is one JSON object {"name": ..., "parameters": {...}};
- harmony: gpt-oss: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`;
- mistral: `[TOOL_CALLS]` then a JSON list of calls, or `NAME[ARGS]{...}` per call.
A call written but unreadable (bad JSON, no name) is not run: the reply ends the rollout, as TRL's parser leaves
it, and is counted (tools/malformed_frequency).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

CallFormat = Literal["hermes", "llama3", "harmony", "mistral"]
PROBE_NAME = "probe_tool_5179"

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
THINKING = re.compile(r"^\s*<think>(.*?)</think>\s*", re.S)
HARMONY_CALL = re.compile(r"to=functions\.([^\s<]+)(?:(?!<\|message\|>).)*<\|message\|>(.*?)"
                          r"(?:<\|call\|>|<\|end\|>|$)", re.S)  # the channel before or after the recipient
HARMONY_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.S)
HARMONY_ANALYSIS = re.compile(r"<\|channel\|>analysis<\|message\|>(.*?)(?:<\|end\|>|$)", re.S)
MISTRAL_NAMED = re.compile(r"([\w.-]+)\[ARGS\](\{.*?\})(?=\[TOOL_CALLS\]|$)", re.S)


def call_format(rendered_probe: str) -> CallFormat | None:
    """The family format of a template, from a conversation it rendered with a call of PROBE_NAME."""
    if f"to=functions.{PROBE_NAME}" in rendered_probe:
        return "harmony"
    if "[TOOL_CALLS]" in rendered_probe:
        return "mistral"
    if "<tool_call>" in rendered_probe:
        return "hermes"
    if re.search(rf'"name"\s*:\s*"{PROBE_NAME}"', rendered_probe):
        return "llama3"
    return None


@dataclass
class Reply:
    """One assistant turn as TRL's reward functions see it, and the calls it wrote that could not be read."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str = ""
    malformed: int = 0

    @property
    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def function_call(name: Any, arguments: Any) -> dict[str, Any] | None:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def from_json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    return function_call(value.get("name"), value.get("arguments", value.get("parameters", {})))


def parse_hermes(text: str) -> Reply:
    thinking = THINKING.match(text)
    reasoning = thinking.group(1).strip() if thinking else ""
    text = text[thinking.end():] if thinking else text
    calls, malformed = [], 0
    for block in HERMES_CALL.findall(text):
        call = from_json_object(block)
        calls.append(call) if call else None
        malformed += call is None
    malformed += text.count("<tool_call>") - len(HERMES_CALL.findall(text))  # opened, never closed
    if malformed:
        return Reply(text.strip(), [], reasoning, malformed)
    return Reply(HERMES_CALL.sub("", text).strip(), calls, reasoning)


def parse_llama3(text: str) -> Reply:
    stripped = text.replace("<|python_tag|>", "").strip()
    if not stripped.startswith("{"):
        return Reply(text.strip())
    call = from_json_object(stripped)
    if call is None:
        return Reply(text.strip(), malformed=int('"name"' in stripped))
    return Reply("", [call])


def parse_harmony(text: str) -> Reply:
    calls, malformed = [], 0
    for name, arguments in HARMONY_CALL.findall(text):
        call = function_call(name, arguments.strip())
        calls.append(call) if call else None
        malformed += call is None
    final, analysis = HARMONY_FINAL.findall(text), HARMONY_ANALYSIS.findall(text)
    content = final[-1].strip() if final else ("" if calls else text.strip())
    if malformed:
        return Reply(content, [], analysis[-1].strip() if analysis else "", malformed)
    return Reply(content, calls, analysis[-1].strip() if analysis else "")


def parse_mistral(text: str) -> Reply:
    before, marker, after = text.partition("[TOOL_CALLS]")
    if not marker:
        return Reply(text.strip())
    after = after.strip()
    calls: list[dict[str, Any] | None]
    if after.startswith("["):
        try:
            listed = json.loads(after)
        except json.JSONDecodeError:
            listed = None
        calls = ([from_json_object(json.dumps(item)) for item in listed] if isinstance(listed, list) else [None])
    else:
        found = MISTRAL_NAMED.findall(after)
        calls = [function_call(name, arguments) for name, arguments in found] or [None]
    if any(call is None for call in calls):
        return Reply(text.strip(), malformed=sum(call is None for call in calls))
    return Reply(before.strip(), [call for call in calls if call])


PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3, "harmony": parse_harmony, "mistral": parse_mistral}


def parse_reply(text: str, form: CallFormat, ends: list[str]) -> Reply:
    """The turn's text (special tokens kept) -> its content and calls; `ends`: end-of-turn strings to drop."""
    text = text.rstrip()
    while any(end and text.endswith(end) for end in ends):
        text = next(text[: -len(end)].rstrip() for end in ends if end and text.endswith(end))
    return PARSERS[form](text)
