"""The Data tab: the recipe's data (a path, a hub id, or a file given to the page) read as the run reads it, its
first records rendered from the token ids training sees (masked tokens shaded), the length of every record read
against the context, and the held-out split. The reading is data_preview.py's; this module lays it out in Gradio
and wires it to the Recipe tab (a file chosen here becomes a `data.path=` line of its overrides)."""

from __future__ import annotations

import html
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gradio as gr
from matplotlib.figure import Figure

from qlora_fsdp.config import Config
from qlora_fsdp.readouts.data_preview import (
    DataPreview,
    data_overrides,
    data_path_of,
    kept_upload,
    preview_data,
    with_overrides_replaced,
)
from qlora_fsdp.studio.events import error_markdown, recipe_inputs, resolved_of, then_refresh_and_plan
from qlora_fsdp.studio.session import Studio

# the page's CSS for the records (app.py adds it to its own): masked tokens shaded, targets plain
DATA_CSS = (".masked {background: #e5e7eb; color: #6b7280; border-radius: 2px} "
            "#data-records pre.data-tokens {white-space: pre-wrap; word-break: break-word; margin: 4px 0 12px} "
            "#data-records .data-head {font-weight: 600; margin-top: 8px} "
            "#data-records .data-row-name {font-style: italic}")
EXTRA = 2  # the overrides box's place in events.recipe_inputs (the picker, the YAML path, then it)
FILE_TYPES = [".jsonl", ".json", ".parquet", ".csv"]  # what the run's reader reads (data/sources.py)


def data_tab(base: Config) -> SimpleNamespace:
    with gr.Row():
        path = gr.Textbox(value=data_path_of(base), label="data: a file, a folder or a hub dataset id",
                          elem_id="data-path", scale=3,
                          info="the recipe's data.path; Preview sets it as an override when changed")
        upload = gr.File(label="or give a file (kept in outputs/studio/uploads/)", file_types=FILE_TYPES,
                         type="filepath", elem_id="data-upload", scale=2)
    preview = gr.Button("Preview", variant="primary", elem_id="data-preview")
    summary = gr.Markdown(elem_id="data-summary")
    lengths = gr.Plot(elem_id="data-lengths", show_label=False)
    records = gr.HTML(elem_id="data-records")
    # the path the box was last set to from the draft: a box the user changed since is an override to set
    synced = gr.State(data_path_of(base))
    return SimpleNamespace(path=path, upload=upload, preview=preview, summary=summary, lengths=lengths,
                           records=records, synced=synced)


def summary_markdown(preview: DataPreview) -> str:
    """Format, template, counts and split in a few lines; the error line alone where the run would refuse."""
    if preview.error:
        return error_markdown(preview.error)
    lines = [f"**data**: `{html.escape(preview.source)}`: {html.escape(preview.kind)}",
             f"**template**: {html.escape(preview.template)}"]
    if preview.n_total:
        read = f" (the first {preview.n_read:,} read)" if preview.capped else ""
        lines += [f"**records**: {preview.n_total:,}{read}; {preview.n_overlong:,} longer than {preview.limit} "
                  f"tokens: {html.escape(preview.overlong)}",
                  f"**held out**: {preview.n_eval:,} eval / {preview.n_train:,} train"]
    lines += [f"- {html.escape(note)}" for note in preview.notes]
    return "\n\n".join(lines)


def lengths_figure(preview: DataPreview) -> Figure | None:
    """The records' lengths as a histogram, the limit (data.context_length; GRPO: the prompt's room) in red."""
    histogram = preview.histogram
    if not histogram.counts:
        return None
    fig = Figure(figsize=(8, 3), layout="tight")
    ax = fig.add_subplot()
    edges = histogram.edges
    ax.bar(edges[:-1], histogram.counts, width=[b - a for a, b in zip(edges, edges[1:], strict=False)],
           align="edge", color="#60a5fa", edgecolor="white")
    ax.axvline(preview.limit, color="#b91c1c", linestyle="--", label=f"limit: {preview.limit} tokens")
    ax.set_xlabel("tokens a record" + (" (a pair: both sequences)" if preview.unit == "pair" else ""))
    ax.set_ylabel("records")
    shown = f"the first {preview.n_read:,} records" if preview.capped else f"all {preview.n_read:,} records"
    ax.set_title(f"lengths of {shown}; {preview.n_overlong:,} over the limit", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def previewed(studio: Studio, path: str, synced: str, *inputs: Any) -> tuple[Any, ...]:
    """(summary, figure, records, overrides, data box, synced) for the draft of `inputs` (the Recipe tab's, as
    events.recipe_inputs lists them: the overrides box third); a path typed into the data box since it was last set
    becomes the overrides' data (so a launch trains on what was previewed), and the box then shows the draft's
    data (an edit of data.path in the form included)."""
    inputs_now = list(inputs)
    resolved = resolved_of(studio, *inputs_now)
    typed = path.strip()
    if resolved.config is not None and typed and typed != synced and typed != data_path_of(resolved.config):
        inputs_now[EXTRA] = with_overrides_replaced(inputs_now[EXTRA], data_overrides(resolved.config, typed))
        resolved = resolved_of(studio, *inputs_now)
    extra = inputs_now[EXTRA]
    if resolved.config is None:
        return error_markdown(resolved.error), None, "", extra, gr.skip(), gr.skip()
    preview = preview_data(resolved.config)
    shown = data_path_of(resolved.config)
    return summary_markdown(preview), lengths_figure(preview), preview.html, extra, shown, shown


def uploaded(studio: Studio, file: str | None, recipe_name: str, yaml_path: str, extra: str) -> tuple[Any, ...]:
    """(data box, synced, overrides, a line) for a file given to the page: kept under outputs/studio/uploads/ and
    named by a `data.path=` line of the overrides (replacing an earlier one)."""
    if not file:
        return gr.skip(), gr.skip(), gr.skip(), ""
    kept = str(kept_upload(Path(file)))
    base, _ = studio.load_recipe(studio.recipe_of(recipe_name, yaml_path))
    return kept, kept, with_overrides_replaced(extra, data_overrides(base, kept)), f"kept as `{html.escape(kept)}`"


def wire_data(studio: Studio, recipe: SimpleNamespace, data: SimpleNamespace,
              plan: SimpleNamespace | None = None) -> None:
    """Preview, a file given, and a recipe picked (the data box then shows its data). With `plan`, a change to the
    overrides refreshes the Recipe tab's command and YAML and plans again, as an edit there does."""
    preview_inputs = [data.path, data.synced, *recipe_inputs(recipe)]
    preview_outputs = [data.summary, data.lengths, data.records, recipe.extra, data.path, data.synced]

    def preview(path: str, synced: str, *inputs: Any) -> tuple[Any, ...]:
        try:
            return previewed(studio, path, synced, *inputs)
        except Exception as err:  # anything but the run's own errors (those are in the summary): its words
            return error_markdown(f"error: {err}"), None, "", gr.skip(), gr.skip(), gr.skip()

    def take(file: str | None, *inputs: Any) -> tuple[Any, ...]:
        try:
            return uploaded(studio, file, *inputs)
        except Exception as err:  # a folder that cannot be written, a file gone
            return gr.skip(), gr.skip(), gr.skip(), error_markdown(f"error: {err}")

    clicked = data.preview.click(preview, preview_inputs, preview_outputs)
    given = data.upload.upload(take, [data.upload, recipe.recipe, recipe.yaml_path, recipe.extra],
                               [data.path, data.synced, recipe.extra, data.summary]).then(
        preview, preview_inputs, preview_outputs)
    if plan is not None:
        for event in (clicked, given):
            then_refresh_and_plan(studio, event, recipe, plan)

    def picked(recipe_name: str, yaml_path: str) -> tuple[Any, Any]:
        cfg, _ = studio.load_recipe(studio.recipe_of(recipe_name, yaml_path))
        shown = data_path_of(cfg) if cfg is not None else gr.skip()
        return shown, shown

    gr.on([recipe.recipe.input, recipe.yaml_path.submit], picked, [recipe.recipe, recipe.yaml_path],
          [data.path, data.synced])
