"""Images in GRPO's prompts, for a vision-language checkpoint: each prompt rendered and encoded by the checkpoint's
processor (its chat template, its expansion of an image into the image's tokens), its image inputs kept beside its
ids for generation and for the update.

A record's images are given as SFT's are (data/images.py): image parts in the prompt's messages (a path or URL in
the part, or TRL's bare `{"type": "image"}` taking the next of the `images` column), LLaMA-Factory's `<image>`
markers with an `images` column, or TRL's `image` column (one picture). A plain-text prompt with an `image` or
`images` column becomes the user's message with the pictures before the text, as TRL's
`prepare_multimodal_messages` places them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import ProcessorMixin

from qlora_fsdp.data.images import MARKER, conversation, render, vision_inputs
from qlora_fsdp.errors import DataError

IMAGE_COLUMNS = ("image", "images")  # TRL's: one picture, or a list of them


def prompts_have_images(records: datasets.Dataset) -> bool:
    """An `image` or `images` column, or a prompt message that shows an image (the first records tell)."""
    if any(column in records.column_names for column in IMAGE_COLUMNS):
        return True
    for record in records.select(range(min(len(records), 64))):
        prompt = record.get("prompt")
        if isinstance(prompt, list) and any(shows_image(m) for m in prompt if isinstance(m, dict)):
            return True
    return False


def shows_image(message: dict[str, Any]) -> bool:
    content = message.get("content")
    if isinstance(content, str):
        return MARKER in content
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content)


def record_images(record: dict[str, Any]) -> list[Any]:
    """The pictures a record's columns give (`images` a list, `image` one), in order."""
    listed = record.get("images")
    one = record.get("image")
    return list(listed or []) + ([one] if one is not None else [])


def prompt_messages(prompt: Any, pictures: list[Any], where: str) -> list[dict[str, Any]]:
    """The prompt as chat messages (plain text: the user's message). Where no message marks the columns' pictures,
    they go before the first user message's text, as TRL's `prepare_multimodal_messages` places them."""
    if isinstance(prompt, str) and prompt:
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise DataError(f"{where}: 'prompt' must be text or a list of chat messages, got {type(prompt).__name__}")
    if not pictures or any(shows_image(m) for m in messages):
        return messages
    first = next((m for m in messages if m["role"] == "user"), None)
    if first is None:
        raise DataError(f"{where}: the record's images need a user message to be shown in")
    content = first.get("content")
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    first["content"] = [{"type": "image"} for _ in pictures] + text
    return messages


def encode_image_prompt(record: dict[str, Any], processor: ProcessorMixin, folder: Path,
                        where: str) -> tuple[list[int], list[dict[str, Any]], dict[str, torch.Tensor] | None]:
    """(the prompt's ids with each image's tokens, its messages as parts, its image inputs or None): rendered with
    the generation prompt, as TRL renders a prompt."""
    pictures = record_images(record)
    messages = prompt_messages(record["prompt"], pictures, where)
    parts, images = conversation({"messages": messages, "images": pictures}, folder, where)
    text = render(processor, parts, where, generation_prompt=True)
    if not images:
        return list(processor.tokenizer(text, add_special_tokens=False)["input_ids"]), parts, None
    out = processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")
    return out["input_ids"][0].tolist(), parts, vision_inputs(out)
