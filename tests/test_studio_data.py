"""The studio's data step (qlora_fsdp/readouts/data_preview.py, studio/data_tab.py): the records shown are the
token ids the run's own pipeline trains on, masked tokens shaded where their labels are masked, the lengths, the
over-long count and the held-out split as the run counts them, and the reader's errors in the command line's
words."""

from __future__ import annotations

import html
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from qlora_fsdp.config import load_config
from qlora_fsdp.data.pair_pipeline import load_pairs
from qlora_fsdp.data.pipeline import load_dataset
from qlora_fsdp.data.prompts import load_prompt_data
from qlora_fsdp.errors import UserError
from qlora_fsdp.labels import IGNORE_INDEX
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.readouts.data_preview import (
    data_overrides,
    kept_upload,
    preview_data,
    with_overrides_replaced,
)
from qlora_fsdp.studio.preflight import check_before_launch
from tests.helpers import head_of

ROOT = Path(__file__).resolve().parents[1]
SPAN = re.compile(r"<span class='masked'>(.*?)</span>|([^<]+)", re.S)


def config(recipe: str, model: Path, data: Path, tmp: Path, *more: str):
    return load_config(recipe, [f"model.path={model}", f"data.path={data}", f"data.cache_dir={tmp / 'cache'}",
                                *more])


def shaded_characters(row_html: str) -> tuple[str, list[bool]]:
    """A row's text (unescaped) and, for each character, whether the page shades it."""
    text, shaded = "", []
    for masked, plain in SPAN.findall(row_html):
        piece = html.unescape(masked or plain)
        text += piece
        shaded += [bool(masked)] * len(piece)
    return text, shaded


def rows_html(preview) -> list[str]:
    return re.findall(r"<pre class='data-tokens'>(.*?)</pre>", preview.html, re.S)


@pytest.mark.parametrize("settings", [(), ("data.context_length=40", "data.overlong=drop")])
def test_sft_records_are_the_runs_own_rows_masked_where_its_labels_are(tmp_path, tiny_model_dir, settings):
    data = head_of("tiny_instruct.jsonl", 60, tmp_path)
    cfg = config("tiny_cpu", tiny_model_dir, data, tmp_path, "data.eval_samples=4", *settings)
    tokenizer = load_tokenizer(cfg)
    preview = preview_data(cfg, shown=6, tokenizer=tokenizer)
    assert not preview.error, preview.error
    run = load_dataset(tokenizer, cfg.data, cfg.train.seed)  # the run's pipeline: rows know their record
    rows = {row["record"]: row for split in (run.train, run.eval) for row in split}
    shown = [record for record in preview.records if not record.note]
    assert shown and all(record.index in rows for record in shown)
    for record in shown:
        ((_, sample),) = record.rows
        assert sample.input_ids == rows[record.index]["input_ids"]
        assert sample.labels == rows[record.index]["labels"]
        assert record.tokens == len(sample.input_ids)
    dropped = [record for record in preview.records if record.note]
    assert all(record.index not in rows and "dropped" in record.note for record in dropped)
    if settings:
        assert dropped, "a 40-token context drops some of the first records"
    # the page's text is the decoding of those ids, shaded exactly where the labels are masked
    for record, row_html in zip(preview.records, rows_html(preview), strict=True):
        ((_, sample),) = record.rows
        text, shaded = shaded_characters(row_html)
        assert text == tokenizer.decode(sample.input_ids, skip_special_tokens=False)
        expected = [label == IGNORE_INDEX for token, label in zip(sample.input_ids, sample.labels, strict=True)
                    for _ in tokenizer.decode([token], skip_special_tokens=False)]
        assert shaded == expected
        assert any(shaded) and not all(shaded)
    # lengths, the over-long count and the split as the run counts them
    assert preview.n_read == preview.n_total == 60 and not preview.capped
    assert sum(preview.histogram.counts) == len(preview.lengths) == 60
    assert len(preview.histogram.edges) == len(preview.histogram.counts) + 1
    assert preview.n_overlong == run.n_overlong
    assert preview.limit == cfg.data.context_length
    assert (preview.n_train, preview.n_eval) == (len(run.train), len(run.eval))
    assert preview.overlong == ("dropped" if settings else "truncated to the context")


def test_the_split_is_the_runs_rule_over_the_whole_data_and_an_eval_file(tmp_path, tiny_model_dir):
    data = head_of("tiny_instruct.jsonl", 90, tmp_path)
    cfg = config("tiny_cpu", tiny_model_dir, data, tmp_path, "data.eval_samples=200")
    tokenizer = load_tokenizer(cfg)
    capped = preview_data(cfg, shown=1, read_at_most=30, tokenizer=tokenizer)
    assert capped.capped and (capped.n_read, capped.n_total) == (30, 90)
    assert sum(capped.histogram.counts) == 30
    assert capped.n_eval == math.ceil(90 / 10) and capped.n_train + capped.n_eval == 90  # scaled to the data
    assert any("first 30 of 90" in note for note in capped.notes)
    held_out = head_of("tiny_kto.jsonl", 1, tmp_path).with_name("held_out.jsonl")
    held_out.write_text("".join((ROOT / "data" / "tiny_instruct.jsonl").read_text().splitlines(True)[-12:]))
    with_file = preview_data(config("tiny_cpu", tiny_model_dir, data, tmp_path, "data.eval_samples=5",
                                    f"data.eval_path={held_out}"), shown=1, tokenizer=tokenizer)
    assert (with_file.n_train, with_file.n_eval) == (90, 5)  # every record trains; 5 of the file's are held out


def test_pairs_kto_and_prompts_show_what_their_runs_read(tmp_path, tiny_model_dir):
    pairs_file = head_of("tiny_preferences.jsonl", 24, tmp_path)
    cfg = config("tiny_cpu_dpo", tiny_model_dir, pairs_file, tmp_path, "data.eval_samples=2")
    tokenizer = load_tokenizer(cfg)
    pairs = preview_data(cfg, shown=24, tokenizer=tokenizer)
    assert not pairs.error and pairs.kind == "preference pairs, format chat" and pairs.template.startswith("chatml")
    assert [name for name, _ in pairs.records[0].rows] == ["chosen", "rejected"]
    run = load_pairs(tokenizer, cfg)
    seen = sorted((tuple(r["chosen_ids"]), tuple(r["rejected_labels"])) for s in (run.train, run.eval) for r in s)
    assert sorted((tuple(r.rows[0][1].input_ids), tuple(r.rows[1][1].labels)) for r in pairs.records) == seen
    assert (pairs.n_train, pairs.n_eval) == (len(run.train), len(run.eval))
    assert "MARBLE" in pairs.html or "capital" in pairs.html

    kto = preview_data(config("tiny_cpu_kto", tiny_model_dir, head_of("tiny_kto.jsonl", 20, tmp_path), tmp_path),
                       shown=2, tokenizer=tokenizer)
    assert not kto.error and kto.kind.startswith("KTO records") and kto.n_read == 20
    assert kto.records[0].rows[0][0] in ("completion (desirable)", "completion (undesirable)")

    prompts_cfg = config("tiny_cpu_grpo", tiny_model_dir, head_of("tiny_prompts.jsonl", 30, tmp_path), tmp_path)
    prompts = preview_data(prompts_cfg, shown=3, tokenizer=tokenizer)
    run_prompts = load_prompt_data(tokenizer, prompts_cfg)
    by_record = {r: ids for split in (run_prompts.train, run_prompts.eval) for r, ids in zip(split.records, split.ids,
                                                                                              strict=True)}
    assert [r.rows[0][1].input_ids for r in prompts.records] == [by_record[i] for i in range(3)]
    assert (prompts.n_train, prompts.n_eval) == (len(run_prompts.train), len(run_prompts.eval))
    assert prompts.limit == prompts_cfg.prompt_room and prompts.kind == (
        "prompts (the policy generates their completions), format prompt")


def test_the_readers_errors_are_the_command_lines_one_line(tmp_path, tiny_model_dir):
    broken = tmp_path / "broken.jsonl"
    lines = (ROOT / "data" / "tiny_instruct.jsonl").read_text().splitlines()[:4]
    broken.write_text("\n".join([lines[0], lines[1], '{"instruction": "cut here', lines[3]]) + "\n")
    missing = tmp_path / "nowhere.jsonl"
    for path in (broken, missing):
        cfg = config("tiny_cpu", tiny_model_dir, path, tmp_path)
        preview = preview_data(cfg)
        with pytest.raises(UserError) as cli:
            check_before_launch(cfg, 2, gpus=0)  # what a launch (and the run's reader) says
        assert preview.error == f"error: {cli.value}" and "\n" not in preview.error
        assert not preview.records and not preview.html
    assert preview_data(config("tiny_cpu", tiny_model_dir, broken, tmp_path)).error.startswith(
        f"error: {broken}:3: not valid JSON")
    assert preview.error == f"error: data source {missing} does not exist"


def test_a_file_given_is_kept_beside_earlier_ones_and_named_by_one_override_line(tmp_path):
    given = tmp_path / "mine.jsonl"
    given.write_text("first\n")
    folder = tmp_path / "uploads"
    first = kept_upload(given, folder)
    given.write_text("second\n")
    second = kept_upload(given, folder)
    assert (first.name, second.name) == ("mine.jsonl", "mine-1.jsonl")
    assert (first.read_text(), second.read_text()) == ("first\n", "second\n")  # never over an earlier file
    extra = "train.max_steps=5\ndata.path=old.jsonl\n"
    assert with_overrides_replaced(extra, data_overrides(None, str(second))) == \
        f"train.max_steps=5\ndata.path={second}"
    several = load_config("tiny_cpu", ["data.sources=[{path: data/tiny_instruct.jsonl}]"])
    lines = data_overrides(several, str(second))
    assert lines == ["data.sources=[]", f"data.path={second}"]
    assert load_config("tiny_cpu", lines).data.path == str(second)


def test_the_data_tab_previews_the_draft_with_the_typed_path_and_a_given_file_becomes_its_override(
        tmp_path, tiny_model_dir, monkeypatch):
    import gradio as gr

    from qlora_fsdp.readouts import data_preview
    from qlora_fsdp.studio.data_tab import data_tab, previewed, uploaded, wire_data
    from qlora_fsdp.studio.events import recipe_inputs
    from qlora_fsdp.studio.session import Studio

    studio = Studio(tmp_path / "studio")
    base = load_config("tiny_cpu")
    with gr.Blocks() as page:  # the tab builds and wires against the Recipe tab's components
        recipe = SimpleNamespace(recipe=gr.Dropdown(["tiny_cpu"], value="tiny_cpu"), yaml_path=gr.Textbox(value=""),
                                 extra=gr.Textbox(value=""), ranks=gr.Number(value=2, precision=0), fields=[])
        data = data_tab(base)
        wire_data(studio, recipe, data)
    ids = [c.elem_id for c in vars(data).values() if getattr(c, "elem_id", None)]
    assert len(ids) == 6 and all(i.startswith("data-") for i in ids) and page is not None

    def page_inputs(extra: str) -> list:  # what the page passes: the Recipe tab's values, the overrides third
        values = [component.value for component in recipe_inputs(recipe)]  # the form's fields come last
        return [*values[:2], extra, *values[3:], *studio.form_for(base)]

    small = head_of("tiny_instruct.jsonl", 30, tmp_path)
    extra = f"model.path={tiny_model_dir}\ndata.cache_dir={tmp_path / 'cache'}"
    summary, figure, records, extra_out, box, synced = previewed(studio, str(small), base.data.path,
                                                                 *page_inputs(extra))
    assert extra_out == f"{extra}\ndata.path={small}" and box == synced == str(small)  # a launch trains on it
    assert "**held out**: 3 eval / 27 train" in summary and "class='masked'" in records and figure is not None
    untouched = previewed(studio, str(small), str(small), *page_inputs(extra))  # a box not typed in: the draft's
    assert untouched[3] == extra and untouched[4] == base.data.path

    monkeypatch.setattr(data_preview.kept_upload, "__defaults__", (tmp_path / "uploads",))
    box, synced, extra_out, line = uploaded(studio, str(small), "tiny_cpu", "", f"{extra}\ndata.path=old.jsonl")
    assert box == synced == str(tmp_path / "uploads" / small.name) and extra_out == f"{extra}\ndata.path={box}"
    assert previewed(studio, "", "", *page_inputs("data.path=nowhere.jsonl"))[0] == \
        "<span class='error-line'>error: data source nowhere.jsonl does not exist</span>"
