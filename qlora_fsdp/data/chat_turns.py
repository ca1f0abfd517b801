"""The tokenizer's own chat template: a conversation -> token ids and labels, the loss only on assistant turns.

The tokenizer's own chat template renders the whole conversation once, and each assistant turn is found in
that one text: it starts after the template's assistant header (what add_generation_prompt writes) and ends
with its end-of-turn token (the special token the template writes after a reply), both learnt once per template
by rendering probe conversations; it must show the message's reply, else the template hides the turn and the
conversation is refused. A template without an assistant header (Mistral's [INST]) opens a turn after the
special token that closes the message before it. A template with `{% generation %}` markers says itself what
the assistant wrote. Tokens are labelled by their character offsets.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import BatchEncoding, PreTrainedTokenizerBase

from qlora_fsdp.data.tool_calls import Message
from qlora_fsdp.errors import DataError, first_line
from qlora_fsdp.labels import IGNORE_INDEX

Span = tuple[int, int]  # character range in the rendered conversation

GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
PROBE_QUESTION, PROBE_REPLY = "Probe question 7319?", "Probe reply 7319."  # learn a template's turn markers
PROBE_VALUE, PROBE_RESULT = "Probe value 7319", "Probe result 7319"
PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_tool", "description": "A probe.", "parameters": {
    "type": "object", "properties": {"probe_argument": {"type": "string"}}}}}]
HIDDEN_TURN = ("the tokenizer's chat template does not show assistant turn {n} of a conversation as a turn of its "
               "own (it drops or rewrites it), so its tokens cannot be located; set data.template to chatml")


def render_chat(messages: list[Message], tokenizer: PreTrainedTokenizerBase, add_generation_prompt: bool = False,
                tools: list[dict[str, Any]] | None = None, chat_template: str | None = None) -> str:
    """The conversation as the tokenizer's chat template (or `chat_template`) writes it, as text."""
    try:
        text = tokenizer.apply_chat_template(messages, tools=as_template_tools(tools), tokenize=False,
                                             add_generation_prompt=add_generation_prompt, chat_template=chat_template)
    except Exception as err:  # the template's raise_exception, or a template tripping over the data
        raise DataError(f"the tokenizer's chat template cannot render a conversation: {first_line(err)}") from None
    assert isinstance(text, str), "tokenize=False renders text"
    return text


def as_template_tools(tools: list[dict[str, Any]] | None) -> list[dict | Callable] | None:
    listed: list[dict | Callable] = list(tools or [])
    return listed or None  # templates test `tools is not none`: no tools must be None, not []


def encode_with_chat_template(messages: list[Message], tools: list[dict[str, Any]],
                              tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    template = tokenizer.get_chat_template(None, tools or None)  # a tokenizer may keep another one for tools
    markers = turn_markers(tokenizer, template)
    messages = as_the_template_wants(messages, markers)
    if GENERATION_TAG.search(template):
        return encode_with_generation_marks(messages, tools, tokenizer)
    full = with_closing_opener(render_chat(messages, tokenizer, tools=tools), messages, markers)
    spans = assistant_spans(messages, full, markers)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [
        token if any(first <= start < last for first, last in spans) else IGNORE_INDEX
        for token, (start, _) in zip(ids, encoded["offset_mapping"], strict=True)
    ]
    return ids, labels


def with_closing_opener(full: str, messages: list[Message], markers: TurnMarkers) -> str:
    """A conversation ending in a reply that a GLM-style template leaves open: closed by the token that closes the
    earlier replies (the next turn's opener), which the turn's target then ends with."""
    if markers.closing_opener is None or not messages or messages[-1]["role"] != "assistant":
        return full
    return full.rstrip() + markers.closing_opener


def encode_with_generation_marks(messages: list[Message], tools: list[dict[str, Any]],
                                 tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The template marks what the assistant wrote with {% generation %}; transformers turns that into a mask."""
    try:
        out = tokenizer.apply_chat_template(messages, tools=as_template_tools(tools), tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    except Exception as err:  # as render_chat
        raise DataError(f"the tokenizer's chat template cannot render a conversation: {first_line(err)}") from None
    assert isinstance(out, dict | BatchEncoding), "return_dict=True returns a dict"
    ids = list(out["input_ids"])
    return ids, [token if marked else IGNORE_INDEX for token, marked in zip(ids, out["assistant_masks"], strict=True)]


@dataclass(frozen=True)
class TurnMarkers:
    """How a chat template frames an assistant turn, learnt by rendering probe conversations."""

    headers: tuple[str, ...]  # what opens an assistant turn: add_generation_prompt's text, then its shorter starts
    # (a thinking model's prompt may end in '<think>\n' that earlier turns lack); () for [INST] templates
    opener: str  # what stands between a question and its reply ('[/INST]'): turns start there without a header
    ends: tuple[str, ...]  # the special tokens that end a reply (gpt-oss: <|end|>, <|return|> for the last, <|call|>)
    specials: tuple[str, ...]  # the tokenizer's special tokens, longest first
    text_arguments: bool = False  # tool call arguments as JSON text, not an object (DeepSeek-V3's, Hermes')
    # GLM's: a reply has no end of its own, the next turn's opening token closes it (a stop token of its generation
    # config) and the last reply is followed by nothing; that token is written after the last reply too, so the
    # model learns to stop (as the template renders the conversation once another turn follows)
    closing_opener: str | None = None


def as_the_template_wants(messages: list[Message], markers: TurnMarkers) -> list[Message]:
    if not markers.text_arguments:
        return messages
    return [{**m, "tool_calls": [with_text_arguments(call) for call in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


def with_text_arguments(call: dict[str, Any]) -> dict[str, Any]:
    arguments = json.dumps(call["function"]["arguments"], ensure_ascii=False)
    return {**call, "function": {**call["function"], "arguments": arguments}}


_MARKERS: dict[tuple[str, str, tuple[str, ...]], TurnMarkers] = {}  # by template, special tokens: rendered once


def turn_markers(tokenizer: PreTrainedTokenizerBase, template: str) -> TurnMarkers:
    specials = tuple(sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special),
                            key=lambda s: (-len(s), s)))
    key = (template, repr(sorted(tokenizer.special_tokens_map.items())), specials)
    if key not in _MARKERS:
        _MARKERS[key] = probe_markers(tokenizer, template, specials)
    return _MARKERS[key]


def probe_markers(tokenizer: PreTrainedTokenizerBase, template: str, specials: tuple[str, ...]) -> TurnMarkers:
    def render(messages: list[Message], prompt: bool = False, tools: list[dict[str, Any]] | None = None) -> str:
        try:
            return render_chat(messages, tokenizer, add_generation_prompt=prompt, tools=tools, chat_template=template)
        except DataError:
            if tools:
                raise
            # a template for tool use may need tools (Hermes' tool_use)
            return render_chat(messages, tokenizer, add_generation_prompt=prompt, tools=PROBE_TOOLS,
                               chat_template=template)

    question: list[Message] = [{"role": "user", "content": PROBE_QUESTION}]
    plain, prompted = render(question), render(question, prompt=True)
    header = prompted[len(shared_start(plain, prompted, specials)):]
    answered = render([*question, {"role": "assistant", "content": PROBE_REPLY}])
    if PROBE_REPLY not in answered:
        raise DataError("the tokenizer's chat template does not show an assistant's reply; set data.template to chatml")
    reply_at = answered.rfind(PROBE_REPLY)
    opener = answered[answered.rfind(PROBE_QUESTION, 0, reply_at) + len(PROBE_QUESTION) : reply_at]
    ends = reply_ends(render, answered, specials)
    text_arguments, call_end = call_markers(render, ends, specials)
    closing = ends[0] if ends and answered.rstrip().endswith(PROBE_REPLY) else None  # nothing after the last reply
    return TurnMarkers(header_starts(header, plain, specials), opener, ends + call_end, specials, text_arguments,
                       closing)


def header_starts(header: str, plain: str, specials: tuple[str, ...]) -> tuple[str, ...]:
    """The header and its starts that end at a line break or a special token, longest first; none that a user
    turn also shows (Qwen's bare '<|im_start|>')."""
    cuts = {len(header)} | {i + 1 for i, char in enumerate(header) if char == "\n"}
    cuts |= {header.find(s) + len(s) for s in specials if s in header}
    starts = (header[:cut] for cut in sorted(cuts, reverse=True))
    return tuple(start for start in starts if start.strip() and start not in plain)


def reply_ends(render: Callable[[list[Message]], str], answered: str, specials: tuple[str, ...]) -> tuple[str, ...]:
    """The special token after a reply, in an earlier turn and in the last (they differ in gpt-oss)."""
    question, earlier = {"role": "user", "content": PROBE_QUESTION}, PROBE_REPLY + " 1"
    probes = [(answered, PROBE_REPLY)]
    two_turns = [question, {"role": "assistant", "content": earlier}, question, {"role": "assistant", "content": "."}]
    try:
        probes.append((render(two_turns), earlier))
    except DataError:  # a template that takes one question only: the last turn's end will do
        pass
    found = [next_special(text, text.find(reply) + len(reply), len(text), specials) for text, reply in probes
             if reply in text]
    return tuple(dict.fromkeys(hit[1] for hit in found if hit))


def call_markers(render: Callable[..., str], ends: tuple[str, ...],
                 specials: tuple[str, ...]) -> tuple[bool, tuple[str, ...]]:
    """(whether the template wants a call's arguments as JSON text, the special token that ends a calling turn
    where it is not a reply's end: gpt-oss's <|call|>), from a probe conversation with a tool call."""
    for text_arguments in (False, True):
        call = {"type": "function", "id": "call00001", "function": {"name": "probe_tool", "arguments": {
            "probe_argument": PROBE_VALUE}}}
        conversation = [{"role": "user", "content": PROBE_QUESTION},
                        {"role": "assistant", "content": "", "tool_calls": [
                            with_text_arguments(call) if text_arguments else call]},
                        {"role": "tool", "content": PROBE_RESULT, "tool_call_id": "call00001"},
                        {"role": "assistant", "content": PROBE_REPLY}]
        try:
            text = render(conversation, tools=PROBE_TOOLS)
        except DataError:  # no tools in this template, or not this way
            continue
        value_at = text.find(PROBE_VALUE)
        result_at = text.find(PROBE_RESULT, max(value_at, 0))
        if value_at < 0 or result_at < 0 or any(end in text[value_at:result_at] for end in ends):
            return text_arguments, ()
        found = next_special(text, value_at, result_at, specials)
        return text_arguments, (found[1],) if found else ()
    return False, ()


def shared_start(plain: str, prompted: str, specials: tuple[str, ...]) -> str:
    """The longest start of `plain` that `prompted` begins with, cut only between tokens (Phi-3 ends a
    conversation with an EOS that the generation prompt replaces: '<|endoftext|>' vs '<|assistant|>')."""
    while not prompted.startswith(plain):
        token = next((s for s in specials if plain.endswith(s)), None)
        plain = plain[: -len(token)] if token else plain[:-1]
    return plain


def next_special(text: str, start: int, stop: int, specials: tuple[str, ...]) -> tuple[int, str] | None:
    """(position, token) of the first of `specials` in text[start:stop]."""
    hits = [(text.find(s, start, stop), s) for s in specials]
    hits = [(at, s) for at, s in hits if at >= 0]
    return min(hits, key=lambda hit: (hit[0], -len(hit[1]))) if hits else None


def anchors(message: Message) -> list[str]:
    """Texts a template shows for a message, any one of which places it: its reply (after any <think> block,
    which Qwen3 drops in earlier turns), trimmed as many templates trim it; its first tool call's name (Llama
    3.1's and Mistral's templates show a calling message's call and drop its text)."""
    texts = [message["content"].rsplit("</think>", 1)[-1].strip()]
    if message.get("tool_calls"):
        texts.append(str(message["tool_calls"][0]["function"]["name"]))
    return [text for text in texts if text] or [""]


def find_anchor(full: str, message: Message, start: int, stop: int, last: bool = False) -> tuple[int, str] | None:
    """(position, text) of the first (or last) of the message's anchors in full[start:stop], the first anchor
    preferred."""
    find = full.rfind if last else full.find
    found = [(find(text, start, stop), text) for text in anchors(message)]
    return next(((at, text) for at, text in found if at >= 0), None)


def assistant_spans(messages: list[Message], full: str, markers: TurnMarkers) -> list[Span]:
    """Character ranges of the assistant turns in the rendered conversation, each from after its header through
    its end-of-turn token, found in order; a turn that cannot be found is refused."""
    spans: list[Span] = []
    cursor, n = 0, 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        n += 1
        span = turn_after_header(messages, index, full, cursor, markers) if markers.headers else None
        if span is None:  # no header; or a reply written without one (DeepSeek-V3's after a tool result)
            span = turn_after_previous(messages, index, full, cursor, markers, strict=bool(markers.headers))
        if span is None:
            raise DataError(HIDDEN_TURN.format(n=n))
        spans.append(span)
        cursor = span[1]
    return spans


def header_at(full: str, start: int, markers: TurnMarkers, exactly: bool = False) -> tuple[int, str] | None:
    """The first header at or after `start` (at `start` only, if exactly), the longest where several start there."""
    found = [(full.find(header, start), header) for header in markers.headers]
    found = [(at, header) for at, header in found if at >= 0 and (at == start or not exactly)]
    return min(found, key=lambda hit: (hit[0], -len(hit[1]))) if found else None


def first_end(full: str, start: int, markers: TurnMarkers) -> tuple[int, str] | None:
    found = [(full.find(end, start), end) for end in markers.ends]
    found = [(at, end) for at, end in found if at >= 0]
    return min(found) if found else None


def turn_after_header(messages: list[Message], index: int, full: str, cursor: int,
                      markers: TurnMarkers) -> Span | None:
    """The next header, then through the end-of-turn token; the reply must lie in between. A reply that comes in
    segments, each with its header (gpt-oss: analysis, then final), is read on to the segment that holds it."""
    header = header_at(full, cursor, markers)
    if header is None:
        return None
    start = at = header[0] + len(header[1])
    while True:
        end = first_end(full, at, markers) if markers.ends else (next_header_or_end(full, at, markers), "")
        if end is None:
            return None
        reply = find_anchor(full, messages[index], start, end[0])
        if reply is not None:  # without end-of-turn tokens, the turn ends with the reply
            return start, (end[0] + len(end[1])) if end[1] else reply[0] + len(reply[1])
        segment = header_at(full, end[0] + len(end[1]), markers, exactly=True) if end[1] else None
        if segment is None:
            return None
        at = segment[0] + len(segment[1])


def next_header_or_end(full: str, start: int, markers: TurnMarkers) -> int:
    header = header_at(full, start, markers)
    return header[0] if header else len(full)


def turn_after_previous(messages: list[Message], index: int, full: str, cursor: int, markers: TurnMarkers,
                        strict: bool = False) -> Span | None:
    """No header ([INST] templates): the turn ends with the first end-of-turn token after the previous turn and
    starts after what opens a reply ('[/INST]'), or after the special token that closes the message before it
    ('[/TOOL_RESULTS]'). Strict: the message before must be found before the reply (else a reply's words in the
    question could pass for it)."""
    end = first_end(full, cursor, markers) if markers.ends else (len(full), "")
    reply = find_anchor(full, messages[index], cursor, end[0], last=True) if end else None
    if end is None or reply is None:
        return None
    start = cursor
    before = find_anchor(full, messages[index - 1], cursor, reply[0], last=True) if index > 0 else None
    if strict and (before is None or not before[1]):
        return None
    if before is not None and before[1]:
        start = before[0] + len(before[1])
        closing = next_special(full, start, reply[0], markers.specials)
        if markers.opener and full.startswith(markers.opener, start):
            start += len(markers.opener)
        elif closing:
            start = closing[0] + len(closing[1])
    return (start, end[0] + len(end[1])) if end[1] else (start, reply[0] + len(reply[1]))
