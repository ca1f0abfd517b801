"""The data step before a launch: a recipe's data read and tokenized by the run's own functions (sources, the
template, the SFT encoder, the pair encoder, GRPO's prompt encoder, the fit to the context, the held-out rule), so
the records shown are the token ids training sees, with what is masked out of the loss marked. Pure Python: the
Data tab (data_tab.py) shows it."""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from qlora_fsdp.config import Config, SourceConfig, merged_overrides
from qlora_fsdp.data.batching import Sample
from qlora_fsdp.data.images import records_have_images
from qlora_fsdp.data.kinds import held_out_sets
from qlora_fsdp.data.kto_records import as_kto_pairs
from qlora_fsdp.data.pair_pipeline import TokenizePair
from qlora_fsdp.data.pair_records import as_pairs, good_pairs
from qlora_fsdp.data.pipeline import Tokenize, fit_to_context, run_template
from qlora_fsdp.data.prompts import encoded_prompts, prompt_encoder, with_prompt_column
from qlora_fsdp.data.sources import as_conversations, eval_source, read_source, sources_of
from qlora_fsdp.errors import UserError
from qlora_fsdp.labels import IGNORE_INDEX
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.readouts.data_render import PreviewRecord, records_html

SHOWN = 5  # records rendered token by token
READ_AT_MOST = 2000  # records read for the lengths and the split (a preview, not a tokenization of a corpus)
BINS = 20
UPLOADS = Path("outputs/studio/uploads")  # where a file given to the page is kept
TEMPLATE_WORDS = {"tokenizer": "the tokenizer's own chat template", "alpaca": "alpaca (named, data/templates.py)",
                  "chatml": "chatml (named, data/templates.py)"}
OVERLONG_WORDS = {"truncate": "truncated to the context", "drop": "dropped",
                  "split": "split into pieces of the context's length"}


@dataclass
class Histogram:
    edges: list[float]  # len(counts) + 1
    counts: list[int]


@dataclass
class DataPreview:
    source: str  # the data's file, folder or hub id (several: joined)
    kind: str = ""  # the data kind the run reads, and the records' format
    template: str = ""  # what renders the records
    unit: str = ""  # what a length counts: a sample, a pair (both sequences), a prompt
    records: list[PreviewRecord] = field(default_factory=list)
    html: str = ""  # the records, masked tokens in <span class='masked'>
    lengths: list[int] = field(default_factory=list)  # tokens of each record read (a pair: both sequences)
    histogram: Histogram = field(default_factory=lambda: Histogram([], []))
    n_read: int = 0  # records read (at most READ_AT_MOST)
    n_total: int = 0  # records in the data
    limit: int = 0  # the length that counts as too long: data.context_length (GRPO: the prompt's room)
    n_overlong: int = 0
    overlong: str = ""  # what the run does with them, in words
    n_train: int = 0
    n_eval: int = 0
    notes: list[str] = field(default_factory=list)
    error: str = ""  # the command line's `error: ...` line

    @property
    def capped(self) -> bool:
        return self.n_read < self.n_total


def source_words(cfg: Config) -> str:
    return ", ".join(s.path for s in sources_of(cfg.data))


def preview_data(cfg: Config, shown: int = SHOWN, read_at_most: int = READ_AT_MOST,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> DataPreview:
    """The recipe's data as its run would read it, or the run's own one-line error."""
    preview = DataPreview(source_words(cfg))
    try:
        fill(preview, cfg, shown, read_at_most, tokenizer or load_tokenizer(cfg))
    except UserError as err:  # the reader's words (file and line), the tokenizer's, the held-out rule's
        return DataPreview(preview.source, preview.kind, preview.template, error=f"error: {err}")
    return preview


def fill(preview: DataPreview, cfg: Config, shown: int, read_at_most: int, tokenizer: PreTrainedTokenizerBase) -> None:
    kind = cfg.train.kind
    formats = ", ".join(dict.fromkeys(s.format for s in sources_of(cfg.data)))
    preview.kind = {"samples": "SFT samples", "pairs": "KTO records (unpaired)" if kind.unpaired
                    else "preference pairs", "prompts": "prompts (the policy generates their completions)"}[
        kind.data] + f", format {formats}"
    if kind.data == "samples" and records_have_images(cfg):
        preview.kind += ", with images"
        preview.template = "the checkpoint's processor (its chat template)"
        preview.notes.append("records with images are rendered by the checkpoint's processor at launch; "
                             "the preview shows text records only")
        return
    template = run_template(cfg.data, tokenizer)
    preview.template = TEMPLATE_WORDS[template]
    if cfg.data.template == "auto":
        preview.template += " (data.template auto: " + ("the tokenizer has one)" if template == "tokenizer"
                                                        else "the tokenizer has none)")
    records, n_total = read_capped(cfg, read_at_most)
    preview.n_read, preview.n_total = sum(len(r) for _, r in records), n_total
    read = {"samples": sft_units, "pairs": pair_units, "prompts": prompt_units}[kind.data]
    units = read(cfg, records, tokenizer, template, shown)
    preview.records, preview.lengths, preview.n_overlong = units.shown, units.lengths, units.n_overlong
    preview.limit, preview.overlong, preview.unit = units.limit, units.overlong, units.unit
    preview.notes += units.notes
    preview.histogram = histogram(units.lengths)
    preview.n_train, preview.n_eval = held_out_counts(cfg, units, preview)
    preview.html = records_html(preview.records, tokenizer)
    if preview.capped:
        preview.notes.append(f"lengths and counts from the first {preview.n_read:,} of {n_total:,} records; the "
                             "split's counts are scaled to the whole data")


def read_capped(cfg: Config, read_at_most: int) -> tuple[list[tuple[SourceConfig, datasets.Dataset]], int]:
    """Each source's records by the run's reader (its errors: a missing file, a broken line), the first
    `read_at_most` of them all; and how many the data holds (sources' weights aside)."""
    out, n_total, room = [], 0, read_at_most
    for source in sources_of(cfg.data):
        records = read_source(source, cfg.data.cache_dir)
        n_total += len(records)
        if room > 0:
            out.append((source, records.select(range(min(room, len(records))))))
            room -= len(out[-1][1])
    return out, n_total


@dataclass
class Units:
    """What a kind's reader gave: the records shown, every record's length, the units the run would train (of the
    records read), and the length limit with what the run does past it."""

    shown: list[PreviewRecord]
    lengths: list[int]
    n_units: int
    n_overlong: int
    limit: int
    overlong: str
    unit: str  # what the held-out rule's error names
    notes: list[str] = field(default_factory=list)


def sft_units(cfg: Config, records: list[tuple[SourceConfig, datasets.Dataset]],
              tokenizer: PreTrainedTokenizerBase, template: str, shown: int) -> Units:
    """Samples through the run's Tokenize and fit_to_context: a record's rows are the pieces training sees."""
    data = cfg.data
    tokenize = Tokenize(tokenizer, template, data.train_on_inputs)  # type: ignore[arg-type]
    ids, labels = [], []
    for source, part in records:
        for conversation in as_conversations(part, source):
            row = tokenize(conversation)
            ids.append(row["input_ids"])
            labels.append(row["labels"])
    fitted = fit_to_context({"input_ids": ids, "labels": labels}, list(range(len(ids))), data.context_length,
                            data.overlong)
    pieces: dict[int, list[tuple[str, Sample]]] = {}
    for piece_ids, piece_labels, record in zip(fitted["input_ids"], fitted["labels"], fitted["record"], strict=True):
        pieces.setdefault(record, []).append(("sample", Sample(piece_ids, piece_labels)))
    preview = []
    for index in range(min(shown, len(ids))):
        rows = pieces.get(index)
        if rows and len(rows) > 1:  # overlong: split, each piece a sample of its own
            rows = [(f"piece {n + 1} of {len(rows)}", sample) for n, (_, sample) in enumerate(rows)]
        why = "longer than data.context_length: dropped" if len(ids[index]) > data.context_length and \
            data.overlong == "drop" else "no target token left after fitting: dropped"
        preview.append(PreviewRecord(index, rows or [("as read", Sample(ids[index], labels[index]))],
                                     "" if rows else why))
    lengths = [len(x) for x in ids]
    n_without = len(ids) - len(pieces) - (sum(n > data.context_length for n in lengths) if data.overlong == "drop"
                                          else 0)
    notes = [f"{n_without} record(s) with no target token are dropped"] if n_without else []
    return Units(preview, lengths, len(fitted["input_ids"]), sum(n > data.context_length for n in lengths),
                 data.context_length, OVERLONG_WORDS[data.overlong], "sample", notes)


def pair_units(cfg: Config, records: list[tuple[SourceConfig, datasets.Dataset]],
               tokenizer: PreTrainedTokenizerBase, template: str, shown: int) -> Units:
    """Pairs (KTO: a record and its KL sequence) through the run's pair reader, encoder and fit."""
    data, unpaired = cfg.data, cfg.train.kind.unpaired
    fit = TokenizePair(tokenizer, template, data.context_length, data.overlong)  # type: ignore[arg-type]
    problems: dict[str, list[Any]] = {"problem": [], "origin": [], "record": []}
    preview: list[Any] = []
    lengths: list[int] = []
    n_units, offset = 0, 0
    for source, part in records:
        pairs = (as_kto_pairs if unpaired else as_pairs)(part, source)
        for index, pair in enumerate(pairs):  # each record through training's own encoder and fit
            outcome = fit.outcome(pair["prompt"], pair["chosen"], pair["rejected"], pair["tools"], unpaired,
                                  pair["problem"])
            if outcome.problem:  # a bad pair, or the run's words for one with no room: reported alike
                problems["problem"].append(outcome.problem)
                problems["origin"].append(pair["origin"])
                problems["record"].append(pair["record"])
            if outcome.encoded is None:
                continue
            lengths.append(outcome.encoded.length)
            n_units += outcome.fitted is not None
            if len(preview) < shown:
                preview.append(pair_record(offset + index, outcome.fitted or outcome.encoded, pair, unpaired,
                                           "" if outcome.fitted else "longer than data.context_length: dropped"))
        offset += len(part)
    _, n_bad = good_pairs(datasets.Dataset.from_dict(problems), cfg.preference.bad_pairs == "drop")
    notes = [f"{n_bad} bad pair(s) dropped (preference.bad_pairs: drop)"] if n_bad else []
    policy = "the longer completion cut first, the prompt kept" if data.overlong == "truncate" else "dropped"
    return Units(preview, lengths, n_units, sum(n > data.context_length for n in lengths), data.context_length,
                 f"{policy} (a pair's two sequences count together)", "pair", notes)


def pair_record(index: int, encoded: Any, pair: dict[str, Any], unpaired: bool, note: str) -> PreviewRecord:
    if unpaired:
        label = "desirable" if pair["desirable"] else "undesirable"
        rows = [(f"completion ({label})", encoded.chosen), ("KL sequence (another record's completion)",
                                                            encoded.rejected)]
    else:
        rows = [("chosen", encoded.chosen), ("rejected", encoded.rejected)]
    return PreviewRecord(index, rows, note)


def prompt_units(cfg: Config, records: list[tuple[SourceConfig, datasets.Dataset]],
                 tokenizer: PreTrainedTokenizerBase, template: str, shown: int) -> Units:
    """Prompts (GRPO's, RLOO's) through the run's encoder (a prompt leaving no room for a completion is its error);
    a prompt is context only: the loss is on the completions generated at each step."""
    preview: list[Any] = []
    lengths: list[int] = []
    for source, part in records:
        prompts = encoded_prompts(with_prompt_column(part, source), source.path,
                                  prompt_encoder(source.path, tokenizer, template, None, None), cfg.prompt_room, False)
        for ids in prompts.ids:
            if len(preview) < shown:
                preview.append(PreviewRecord(len(lengths), [("prompt", Sample(ids, [IGNORE_INDEX] * len(ids)))]))
            lengths.append(len(ids))
    notes = ["a plain-text prompt is tokenized as it is; chat prompts get the template's generation prompt"]
    if cfg.multi_turn_rollouts:
        notes.append("the tools' listing is added to each prompt at launch (not shown here)")
    return Units(preview, lengths, len(lengths), sum(n > cfg.prompt_room for n in lengths), cfg.prompt_room,
                 "refused: the run stops with an error naming the record", "prompt", notes)


def histogram(lengths: list[int], bins: int = BINS) -> Histogram:
    """Equal-width bins (a token at least) from the shortest record to the longest, the last one closed."""
    if not lengths:
        return Histogram([], [])
    low, high = min(lengths), max(lengths)
    width = max(1, math.ceil((high + 1 - low) / bins))
    n_bins = math.ceil((high + 1 - low) / width)
    counts = [0] * n_bins
    for n in lengths:
        counts[(n - low) // width] += 1
    return Histogram([float(low + i * width) for i in range(n_bins + 1)], counts)


def held_out_counts(cfg: Config, units: Units, preview: DataPreview) -> tuple[int, int]:
    """(train, held out) by the run's own rule, over the units the whole data would give (scaled from the records
    read where only some were) and the eval file's records."""
    n_units = units.n_units
    if not n_units:  # the run refuses such data before it splits it; the records above show why
        preview.notes.append(f"no {units.unit} of the records read is left to train after fitting to the context: "
                             "the run refuses this data")
        return 0, 0
    whole = round(n_units * preview.n_total / preview.n_read) if preview.capped and preview.n_read else n_units
    held_out = eval_source(cfg.data)
    n_file = len(read_source(held_out, cfg.data.cache_dir)) if held_out is not None else None
    if held_out is not None and n_file is not None:
        preview.notes.append(f"held out: data.eval_samples of the {n_file:,} records of {held_out.path}")
    # only the counts matter here: a split's picked indices stand for its units
    train, held = held_out_sets(list(range(whole)), None if n_file is None else list(range(n_file)),
                                lambda split, picked: picked, cfg.data.eval_samples, cfg.train.seed, units.unit)
    return len(train), len(held)


# ---- the data's file, as the page sets it -------------------------------------------------------------------

def data_path_of(cfg: Config) -> str:
    """What the page's data box shows: the first source's path."""
    return sources_of(cfg.data)[0].path


def data_overrides(cfg: Config | None, path: str) -> list[str]:
    """The overrides that make `path` the run's data: data.path, and for a recipe of several sources, none of
    them (data.path is read only where data.sources is empty)."""
    return [*(["data.sources=[]"] if cfg is not None and cfg.data.sources else []), f"data.path={path.strip()}"]


def with_overrides_replaced(extra: str, overrides: list[str]) -> str:
    """The free-text overrides with each of `overrides` replacing any earlier line of its key (last line wins)."""
    return "\n".join(merged_overrides(extra.splitlines(), overrides))


def kept_upload(uploaded: Path, folder: Path = UPLOADS) -> Path:
    """A copy of an uploaded file under `folder`, by its name; never over an existing file (a suffix is added:
    a run launched from the earlier one still reads the data it was launched with)."""
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(10_000):
        target = folder / (uploaded.name if n == 0 else f"{uploaded.stem}-{n}{uploaded.suffix}")
        try:
            with open(target, "xb") as out, open(uploaded, "rb") as source:  # "x": never an existing file
                shutil.copyfileobj(source, out)
            return target
        except FileExistsError:
            continue
    raise UserError(f"{folder} holds 10,000 copies of {uploaded.name}; clear it")
