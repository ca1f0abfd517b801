"""Conversations -> token ids and labels, with the loss only on what the model should learn to say.

This module chooses the template and encodes with it; the named templates (alpaca, chatml) live here. They are
built from segments (text or token ids, each trained on or not), tokenized one by one so no token straddles a
prompt/response boundary. The tokenizer's own chat template is read in chat_turns.py, and tool calls and tools
are parsed in tool_calls.py.
"""

from __future__ import annotations

import json
from typing import Any

from transformers import PreTrainedTokenizerBase

from qlora_fsdp.config import DataFormat, Template, TemplateChoice
from qlora_fsdp.data.chat_turns import (
    IGNORE_INDEX,
    as_the_template_wants,
    encode_with_chat_template,
    render_chat,
    turn_markers,
)
from qlora_fsdp.data.tool_calls import Message, has_tools, parsed_tools, template_messages
from qlora_fsdp.errors import DataError

Segment = tuple[str | list[int], bool]  # (text or token ids, is a training target)

ALPACA_PROMPT = "### Instruction:\n{content}\n\n### Response:\n"
CHATML_TOOLS = ("You can call the functions below. To call one, write <tool_call>\n{{\"name\": <its name>, "
                "\"arguments\": <a JSON object>}}\n</tool_call> in your reply.\n<tools>\n{tools}\n</tools>")


def choose_template(template: TemplateChoice, tokenizer: PreTrainedTokenizerBase, data_format: DataFormat) -> Template:
    """`auto`: the tokenizer's chat template where it has one, else alpaca for alpaca data, chatml for chats."""
    has_own = bool(getattr(tokenizer, "chat_template", None))
    if template == "tokenizer" and not has_own:
        raise DataError("data.template=tokenizer, but the tokenizer has no chat template; choose alpaca or chatml")
    if template == "tokenizer" or template == "alpaca" or template == "chatml":
        return template
    if has_own:
        return "tokenizer"
    return "alpaca" if data_format == "alpaca" else "chatml"


def encode(
    messages: list[Message], tokenizer: PreTrainedTokenizerBase, template: Template, train_on_inputs: bool,
    tools: str | list | None = None,
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) with labels[t] = input_ids[t] where token t is a target, else IGNORE_INDEX.

    `tools`: the function schemas the conversation may call (a list, or its JSON text)."""
    if messages and messages[0]["role"] == "text":  # plain text: every token is a target
        segments: list[Segment] = [(messages[0]["content"], True), ([tokenizer.eos_token_id], True)]
        ids, labels = encode_segments(with_bos(segments, tokenizer), tokenizer)
    elif template == "tokenizer":
        ids, labels = encode_with_chat_template(template_messages(messages), parsed_tools(tools), tokenizer)
    else:
        segments = named_segments(template, template_messages(messages), parsed_tools(tools), tokenizer)
        ids, labels = encode_segments(with_bos(segments, tokenizer), tokenizer)
    return ids, (list(ids) if train_on_inputs else labels)


def prompt_ids(messages: list[Message], tokenizer: PreTrainedTokenizerBase, template: Template,
               tools: str | list | None = None) -> list[int]:
    """Token ids that open the assistant's next turn, exactly as training rendered the part before a response."""
    return conversation_ids(messages, tokenizer, template, parsed_tools(tools), add_generation_prompt=True)


def conversation_ids(messages: list[Message], tokenizer: PreTrainedTokenizerBase, template: Template,
                     tools: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    chat = template_messages(messages)
    if template == "tokenizer":
        markers = turn_markers(tokenizer, tokenizer.get_chat_template(None, tools or None))
        chat = as_the_template_wants(chat, markers)
        text = render_chat(chat, tokenizer, add_generation_prompt=add_generation_prompt, tools=tools)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    segments = named_segments(template, chat, tools, tokenizer)
    if template == "chatml" and add_generation_prompt:
        segments.append(("<|im_start|>assistant\n", False))
    return encode_segments(with_bos(segments, tokenizer), tokenizer)[0]


# ---- named templates ------------------------------------------------------------------------------

def named_segments(template: Template, messages: list[Message], tools: list[dict[str, Any]],
                   tokenizer: PreTrainedTokenizerBase) -> list[Segment]:
    if template == "chatml":
        return chatml_segments(messages, tokenizer, tools)
    if has_tools(messages, tools):
        raise DataError("the alpaca template has no way to show tools, tool calls or tool results; set "
                        "data.template to chatml, or use a tokenizer whose chat template supports tools")
    return alpaca_segments(messages, tokenizer)


def with_bos(segments: list[Segment], tokenizer: PreTrainedTokenizerBase) -> list[Segment]:
    return [([tokenizer.bos_token_id], False), *segments] if tokenizer.bos_token_id is not None else segments


def reply_text(message: Message) -> str:
    """An assistant message as named templates write it: reasoning in <think> tags, the reply, then its tool
    calls Hermes-style, one JSON object in <tool_call> tags each (the convention Qwen's templates follow)."""
    text = f"<think>\n{message['reasoning_content']}\n</think>\n\n" if message.get("reasoning_content") else ""
    text += message["content"]
    for call in message.get("tool_calls", []):
        function = call["function"]
        text += ("\n" if text else "") + "<tool_call>\n" + json.dumps(
            {"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False) + "\n</tool_call>"
    return text


def alpaca_segments(messages: list[Message], tokenizer: PreTrainedTokenizerBase) -> list[Segment]:
    segments: list[Segment] = []
    for message in messages:
        if message["role"] == "assistant":
            segments += [(reply_text(message), True), ([tokenizer.eos_token_id], True)]
        elif message["role"] == "system":
            segments.append((message["content"] + "\n\n", False))
        else:
            segments.append((("\n\n" if segments else "") + ALPACA_PROMPT.format(content=message["content"]), False))
    return segments


def chatml_segments(messages: list[Message], tokenizer: PreTrainedTokenizerBase,
                    tools: list[dict[str, Any]] | None = None) -> list[Segment]:
    """ChatML; tools are listed in the system turn, tool results are `tool` turns (never targets)."""
    segments: list[Segment] = []
    for message in with_tools_listed(messages, tools or []):
        segments.append((f"<|im_start|>{message['role']}\n", False))
        is_target = message["role"] == "assistant"
        segments.append(((reply_text(message) if is_target else message["content"]) + "<|im_end|>", is_target))
        if is_target:
            segments.append(([tokenizer.eos_token_id], True))
        segments.append(("\n", False))
    return segments


def with_tools_listed(messages: list[Message], tools: list[dict[str, Any]]) -> list[Message]:
    if not tools:
        return messages
    listing = CHATML_TOOLS.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + listing}, *messages[1:]]
    return [{"role": "system", "content": listing}, *messages]


def encode_segments(segments: list[Segment], tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    labels: list[int] = []
    for content, is_target in segments:
        piece = content if isinstance(content, list) else tokenizer(content, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if is_target else [IGNORE_INDEX] * len(piece)
    return ids, labels
