"""Chat records with images, for a vision-language checkpoint: each turned into token ids, labels and the image
inputs by the checkpoint's own processor (AutoProcessor: its chat template, its image processor, its expansion of
an image marker into the image's tokens).

A record is a chat (`messages`) whose message content is text, or a list of parts: `{"type": "text", "text": ...}`
and `{"type": "image", "image": "photo.png"}` (a path, relative to the data file's folder or absolute, or an http(s)
URL). LLaMA-Factory's form is read too: `<image>` markers in the text and an `images` column with one path a marker,
in order; and a hub dataset's `Image` feature in that column. Records without images mix in.

Labels: the assistant's replies only, never an image token or a prompt. The conversation is rendered once by the
processor's template; each assistant reply is the text the template adds between the conversation before it (with
the generation prompt) and the conversation through it, so templates must render turns as prefixes (every
published chat template does). The text is tokenized with offsets, then aligned to the processor's ids, which
differ where each image marker became the image's tokens (and, for Gemma 3, the text around them).
"""

from __future__ import annotations

import difflib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from PIL import Image
from transformers import PreTrainedTokenizerBase, ProcessorMixin

from qlora_fsdp.config import Config, SourceConfig
from qlora_fsdp.data.batching import Sample, pack
from qlora_fsdp.data.kinds import held_out_sets
from qlora_fsdp.data.sources import eval_source, read_source, sources_of
from qlora_fsdp.errors import DataError, first_line
from qlora_fsdp.labels import IGNORE_INDEX

MARKER = "<image>"  # LLaMA-Factory's marker in a message's text
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")  # the rest is the images'


@dataclass
class ImageData:
    """The trainer's view of image records: samples in memory, each with its image inputs."""

    train: list[Sample]
    eval: list[Sample]
    template: str
    n_records: int
    packs: list[list[int]] | None = None
    has_images = True  # the image side loads beside the decoder (not a field: no annotation)

    @property
    def n_units(self) -> int:
        return len(self.packs) if self.packs is not None else len(self.train)

    def unit_lengths(self) -> list[int]:
        lengths = [len(s.input_ids) for s in self.train]
        return [sum(lengths[i] for i in row) for row in self.packs] if self.packs is not None else lengths

    def samples(self, split: Any, indices: list[int]) -> list[Sample]:
        return [split[i] for i in indices]

    def describe(self, context_length: int, overlong: str) -> str:
        images = sum(s.vision is not None for s in self.train + self.eval)
        rows = f", packed into {len(self.packs)} rows" if self.packs is not None else ""
        return (f"{self.n_records} records ({images} with images), {len(self.train)} train / {len(self.eval)} eval "
                f"samples{rows} (template {self.template})")


def has_images(records: datasets.Dataset) -> bool:
    """An `images` column, or a message whose content lists an image part (the first records tell)."""
    if "images" in records.column_names:
        return True
    if "messages" not in records.column_names:
        return False
    for record in records.select(range(min(len(records), 64))):
        for message in record["messages"] or []:
            content = message.get("content")
            if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
                return True
    return False


def read_image(value: Any, folder: Path, where: str) -> Image.Image:
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict) and value.get("bytes") is not None:  # a hub Image feature, undecoded
        return Image.open(io.BytesIO(value["bytes"])).convert("RGB")
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: an image is given as {type(value).__name__}, not a path")
    if value.startswith(("http://", "https://")):
        return fetched_image(value, where)
    path = Path(value) if Path(value).is_absolute() else folder / value
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as err:
        raise DataError(f"{where}: image {value} cannot be read ({first_line(err)})") from None


def fetched_image(url: str, where: str) -> Image.Image:
    """An image given by URL, read once at start (a minute at most: a dead link is one line, not a hang)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=60) as response:  # noqa: S310 (http and https only, checked)
            data = response.read()
        return Image.open(io.BytesIO(data)).convert("RGB")
    except (OSError, ValueError) as err:
        raise DataError(f"{where}: image {url} cannot be fetched or read ({first_line(err)})") from None


def parts_of(content: Any, images: list[Any], where: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """A message's content as parts, and the images it shows, in order (LLaMA-Factory's markers take from
    `images`, which this consumes)."""
    if isinstance(content, list):
        parts, shown = [], []
        for part in content:
            if part.get("type") == "image":
                given = part.get("image") or part.get("path") or part.get("url")
                if given is None:  # TRL's form: the part marks the place, `images` holds the image, in order
                    if not images:
                        raise DataError(f"{where}: an image part without an image, and no `images` left for it")
                    given = images.pop(0)
                shown.append(given)
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part.get("text") or ""})
        return parts, shown
    if not isinstance(content, str):
        raise DataError(f"{where}: a message's content is {type(content).__name__}, not text or a list of parts")
    pieces = content.split(MARKER)
    if len(pieces) - 1 > len(images):
        raise DataError(f"{where}: {len(pieces) - 1} {MARKER} markers but {len(images)} images left in `images`")
    parts, shown = [], []
    for index, piece in enumerate(pieces):
        if index:
            parts.append({"type": "image"})
            shown.append(images.pop(0))
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts, shown


def conversation(record: dict[str, Any], folder: Path, where: str) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """The record's messages with content as parts, and its images read, in the order they are shown."""
    left = list(record.get("images") or [])
    messages, shown = [], []
    for message in record.get("messages") or []:
        parts, images = parts_of(message.get("content"), left, where)
        messages.append({"role": message["role"], "content": parts})
        shown += images
    if left:
        raise DataError(f"{where}: {len(left)} of the record's `images` have no {MARKER} marker in its messages")
    if not messages:
        raise DataError(f"{where}: the record has no messages")
    return messages, [read_image(image, folder, where) for image in shown]


def render(processor: ProcessorMixin, messages: list[dict[str, Any]], where: str,
           generation_prompt: bool = False) -> str:
    try:
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as err:  # the template's raise_exception, or a template tripping over the data
        raise DataError(f"{where}: the processor's chat template cannot render the conversation "
                        f"({first_line(err)})") from None
    assert isinstance(text, str), "tokenize=False renders text"
    return text


def reply_spans(processor: ProcessorMixin, messages: list[dict[str, Any]], full: str,
                where: str) -> list[tuple[int, int]]:
    """Character ranges of the assistant's replies in the rendered conversation."""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if index == 0:
            raise DataError(f"{where}: the conversation opens with the assistant; start it with a user message")
        before = render(processor, messages[:index], where, generation_prompt=True)
        through = render(processor, messages[: index + 1], where)
        if not (full.startswith(before) and full.startswith(through) and len(through) > len(before)):
            raise DataError(f"{where}: the processor's chat template does not render the conversation turn by turn "
                            "(a reply's text is not the rendering's prefix), so its replies cannot be located")
        spans.append((len(before), len(through)))
    return spans


def expanded_labels(plain: list[int], labels: list[int], expanded: list[int], where: str) -> list[int]:
    """The labels of the processor's ids, which differ from the tokenizer's where each image marker became the
    image's tokens (and, for some families, the text around them): aligned by the longest common runs, whatever
    the processor added is no target; a reply it changed is refused."""
    out = [IGNORE_INDEX] * len(expanded)
    for tag, a, b, c, d in difflib.SequenceMatcher(a=plain, b=expanded, autojunk=False).get_opcodes():
        if tag == "equal":
            out[c:d] = labels[a:b]
        elif any(label != IGNORE_INDEX for label in labels[a:b]):
            raise DataError(f"{where}: the processor changed the tokens of a reply, not only the images'")
    return out


def encode_record(record: dict[str, Any], processor: ProcessorMixin, folder: Path,
                  where: str) -> Sample:
    messages, images = conversation(record, folder, where)
    full = render(processor, messages, where)
    spans = reply_spans(processor, messages, full, where)
    tokenizer: PreTrainedTokenizerBase = processor.tokenizer
    plain = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = [token if any(a <= start < b for a, b in spans) else IGNORE_INDEX
              for token, (start, _) in zip(plain["input_ids"], plain["offset_mapping"], strict=True)]
    if not images:
        return Sample(list(plain["input_ids"]), labels)
    out = processor(text=[full], images=images, add_special_tokens=False, return_tensors="pt")
    expanded = out["input_ids"][0].tolist()
    return Sample(expanded, expanded_labels(list(plain["input_ids"]), labels, expanded, where), vision_inputs(out))


def vision_inputs(out: Any) -> dict[str, torch.Tensor]:
    """What the image side reads of one sample's processor output: its tensors but the text's, one item an image
    along the first axis (so a micro-batch's samples join by concatenation)."""
    vision = {key: value for key, value in out.items() if key not in TEXT_INPUTS and isinstance(value, torch.Tensor)}
    if vision.pop("cross_attention_mask", None) is not None:  # Llama 3.2 Vision: remade from the ids per sample,
        vision = {key: value[0] for key, value in vision.items()}  # and its images without the sample axis
    return vision


def encoded_source(source: SourceConfig, processor: ProcessorMixin, cfg: Config) -> list[Sample]:
    """A source's records through the processor, each within data.context_length."""
    records = read_source(source, cfg.data.cache_dir)
    path = Path(source.path)
    folder = path if path.is_dir() else path.parent
    samples = []
    for index, record in enumerate(records):
        where = f"{source.path} record {index + 1}"
        sample = encode_record(record, processor, folder, where)
        if len(sample.input_ids) > cfg.data.context_length:
            raise DataError(f"{where}: {len(sample.input_ids)} tokens with its images, more than "
                            f"data.context_length {cfg.data.context_length}; raise it or lower the images' pixel "
                            "budget")
        samples.append(sample)
    return samples


def load_image_data(processor: ProcessorMixin, cfg: Config) -> ImageData:
    """Every source's records encoded; held out as text data is (data/kinds.py): data.eval_path's records where
    given, else data.eval_samples of the records, at most a tenth (by the seed); packed where the recipe packs."""
    data = cfg.data
    samples = [sample for source in sources_of(data) for sample in encoded_source(source, processor, cfg)]
    held_out_source = eval_source(data)
    held_out = encoded_source(held_out_source, processor, cfg) if held_out_source is not None else None
    train, eval_set = held_out_sets(samples, held_out, lambda split, picked: [split[i] for i in sorted(picked)],
                                    data.eval_samples, cfg.train.seed, "sample")
    packs = pack([len(s.input_ids) for s in train], data.context_length) if data.packing else None
    return ImageData(train, eval_set, "processor", len(samples), packs)


def records_have_images(cfg: Config) -> bool:
    """Whether the recipe's data holds images (a chat data source, for training or held out, whose records show
    some): the held-out records are then read as the training ones are, through the processor."""
    held_out = eval_source(cfg.data)
    for source in [*sources_of(cfg.data), *([held_out] if held_out is not None else [])]:
        if source.format != "chat":
            continue
        if has_images(read_source(source, cfg.data.cache_dir)):
            return True
    return False

