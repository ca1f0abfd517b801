"""Records as HTML, decoded from the very token ids training sees: a run of tokens masked out of the loss (label
IGNORE_INDEX) is shaded (`<span class='masked'>`), the targets are plain text."""

from __future__ import annotations

import html
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from qlora_fsdp.data.batching import Sample
from qlora_fsdp.labels import IGNORE_INDEX

LEGEND = ("<p class='data-legend'><span class='masked'>shaded</span>: masked out of the loss (label "
          f"{IGNORE_INDEX}); plain: what the model learns to say</p>")



@dataclass
class PreviewRecord:
    """One record as the run tokenizes it: its rows (one sample; a pair's chosen and rejected; a prompt), each
    (name, the ids and labels training sees); `note` says what the run does with it where it is not trained as is."""

    index: int  # 0-based, in the data's order
    rows: list[tuple[str, Sample]]
    note: str = ""

    @property
    def tokens(self) -> int:
        return sum(len(sample.input_ids) for _, sample in self.rows)


def decoded_runs(ids: list[int], labels: list[int], tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, bool]]:
    """(text, masked) for each run of tokens alike. Each run's text is the growth of the decoded prefix, so the runs
    join into the decoding of the whole row (a run decoded alone would lose a word's leading space in some
    tokenizers)."""
    out: list[tuple[str, bool]] = []
    start, before = 0, ""
    for end in range(1, len(ids) + 1):
        masked = labels[start] == IGNORE_INDEX
        if end < len(ids) and (labels[end] == IGNORE_INDEX) == masked:
            continue
        text = str(tokenizer.decode(ids[:end], skip_special_tokens=False, clean_up_tokenization_spaces=False))
        piece = text[len(before):] if text.startswith(before) else str(tokenizer.decode(
            ids[start:end], skip_special_tokens=False, clean_up_tokenization_spaces=False))
        out.append((piece, masked))
        start, before = end, text
    return out


def row_html(ids: list[int], labels: list[int], tokenizer: PreTrainedTokenizerBase) -> str:
    return "".join(f"<span class='masked'>{html.escape(text)}</span>" if masked else html.escape(text)
                   for text, masked in decoded_runs(ids, labels, tokenizer))


def records_html(records: list[PreviewRecord], tokenizer: PreTrainedTokenizerBase) -> str:
    parts = [LEGEND] if records else []
    for record in records:
        note = f": {html.escape(record.note)}" if record.note else ""
        parts.append(f"<div class='data-record'><div class='data-head'>record {record.index + 1}, "
                     f"{record.tokens} tokens{note}</div>")
        for name, sample in record.rows:
            parts.append(f"<div class='data-row'><span class='data-row-name'>{html.escape(name)}</span> "
                         f"({len(sample.input_ids)} tokens)<pre class='data-tokens'>"
                         f"{row_html(sample.input_ids, sample.labels, tokenizer)}</pre></div>")
        parts.append("</div>")
    return "".join(parts)
