"""Conversations -> token ids and labels, with the loss only on what the model should learn to say.

Named templates are built from segments (text or token ids, each trained on or not), tokenized one by one
so no token straddles a prompt/response boundary. The tokenizer's own chat template is rendered whole;
assistant turns are located by rendering each prefix of the conversation, and tokens are labelled by
their character offsets.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from qlora_fsdp.config import DataFormat, Template, TemplateChoice
from qlora_fsdp.errors import DataError

IGNORE_INDEX = -100
Message = dict[str, str]
Segment = tuple[str | list[int], bool]  # (text or token ids, is a training target)

ALPACA_PROMPT = "### Instruction:\n{content}\n\n### Response:\n"


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
    messages: list[Message], tokenizer: PreTrainedTokenizerBase, template: Template, train_on_inputs: bool
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) with labels[t] = input_ids[t] where token t is a target, else IGNORE_INDEX."""
    if messages and messages[0]["role"] == "text":  # plain text: every token is a target
        segments: list[Segment] = [(messages[0]["content"], True), ([tokenizer.eos_token_id], True)]
        ids, labels = encode_segments(with_bos(segments, tokenizer), tokenizer)
    elif template == "tokenizer":
        ids, labels = encode_with_chat_template(messages, tokenizer)
    else:
        build = alpaca_segments if template == "alpaca" else chatml_segments
        ids, labels = encode_segments(with_bos(build(messages, tokenizer), tokenizer), tokenizer)
    return ids, (list(ids) if train_on_inputs else labels)


def with_bos(segments: list[Segment], tokenizer: PreTrainedTokenizerBase) -> list[Segment]:
    return [([tokenizer.bos_token_id], False), *segments] if tokenizer.bos_token_id is not None else segments


def alpaca_segments(messages: list[Message], tokenizer: PreTrainedTokenizerBase) -> list[Segment]:
    segments: list[Segment] = []
    for message in messages:
        if message["role"] == "assistant":
            segments += [(message["content"], True), ([tokenizer.eos_token_id], True)]
        elif message["role"] == "system":
            segments.append((message["content"] + "\n\n", False))
        else:
            segments.append((("\n\n" if segments else "") + ALPACA_PROMPT.format(content=message["content"]), False))
    return segments


def chatml_segments(messages: list[Message], tokenizer: PreTrainedTokenizerBase) -> list[Segment]:
    segments: list[Segment] = []
    for message in messages:
        segments.append((f"<|im_start|>{message['role']}\n", False))
        is_target = message["role"] == "assistant"
        segments.append((message["content"] + "<|im_end|>", is_target))
        if is_target:
            segments.append(([tokenizer.eos_token_id], True))
        segments.append(("\n", False))
    return segments


def encode_segments(segments: list[Segment], tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    labels: list[int] = []
    for content, is_target in segments:
        piece = content if isinstance(content, list) else tokenizer(content, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if is_target else [IGNORE_INDEX] * len(piece)
    return ids, labels


def render_chat(messages: list[Message], tokenizer: PreTrainedTokenizerBase,
                add_generation_prompt: bool = False) -> str:
    """The conversation as the tokenizer's chat template writes it, as text."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert isinstance(text, str), "tokenize=False renders text"
    return text


def encode_with_chat_template(messages: list[Message], tokenizer: PreTrainedTokenizerBase) -> tuple[list, list]:
    full = render_chat(messages, tokenizer)
    spans = assistant_spans(messages, tokenizer, full)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [
        token if any(first <= start < last for first, last in spans) else IGNORE_INDEX
        for token, (start, _) in zip(ids, encoded["offset_mapping"], strict=True)
    ]
    return ids, labels


def assistant_spans(messages: list[Message], tokenizer: PreTrainedTokenizerBase, full: str) -> list[tuple[int, int]]:
    """Character ranges of the assistant turns in the rendered conversation (their closing tokens included)."""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(messages[:index], tokenizer, add_generation_prompt=True)
        through = render_chat(messages[: index + 1], tokenizer)
        if not (full.startswith(before) and full.startswith(through)):
            raise DataError("the tokenizer's chat template renders earlier turns differently in longer chats, so "
                            "assistant turns cannot be located; set data.template to chatml or alpaca")
        spans.append((len(before), len(through)))
    return spans


def prompt_ids(messages: list[Message], tokenizer: PreTrainedTokenizerBase, template: Template) -> list[int]:
    """Token ids that open the assistant's next turn, exactly as training rendered the part before a response."""
    if template == "tokenizer":
        text = render_chat(messages, tokenizer, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if template == "alpaca":
        segments = alpaca_segments(messages, tokenizer)
    else:
        segments = [*chatml_segments(messages, tokenizer), ("<|im_start|>assistant\n", False)]
    return encode_segments(with_bos(segments, tokenizer), tokenizer)[0]
