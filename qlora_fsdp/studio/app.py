"""The studio's page, laid out in Gradio: Recipe (picker, schema form, YAML, command), Data (the records as the
model sees them), Plan (pictures and levers), Run (launch, curves, completions, stop, resume, any run folder),
Hardware (GPUs, host RAM, each step's peaks) and After (chat, compare, merge, GGUF). Each action calls
session.py; nothing here computes."""

from __future__ import annotations

import os
import time
import urllib.request
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home from a local page

import gradio as gr  # noqa: E402

from qlora_fsdp.config import Config  # noqa: E402
from qlora_fsdp.studio.chat import BASE_MODEL  # noqa: E402
from qlora_fsdp.studio.data_tab import DATA_CSS, data_tab, wire_data  # noqa: E402
from qlora_fsdp.studio.draft import default_ranks  # noqa: E402
from qlora_fsdp.studio.events import MAX_LEVERS, RUNS_ROOT, wire_after, wire_plan, wire_recipe, wire_run  # noqa: E402
from qlora_fsdp.studio.export_view import GGUF_TYPES, default_gguf_type  # noqa: E402
from qlora_fsdp.studio.form import Field  # noqa: E402
from qlora_fsdp.studio.hardware_tab import hardware_tab, hardware_tick  # noqa: E402
from qlora_fsdp.studio.session import Studio, adapters_under  # noqa: E402
from qlora_fsdp.studio.ticks import IDLE_TICK_S, wire_ticks  # noqa: E402

CSS = ".error-line {color: #b91c1c; font-weight: 600} " + DATA_CSS


def field_component(field: Field, value: Any) -> Any:
    common: dict[str, Any] = {"label": field.key, "info": field.help, "elem_id": field.element_id}
    if field.kind == "bool":
        return gr.Checkbox(value=value, **common)
    if field.kind == "choice":
        return gr.Dropdown(choices=list(field.choices), value=value, allow_custom_value=False, **common)
    return gr.Textbox(value=value, lines=1, max_lines=4, **common)


def recipe_tab(studio: Studio, base: Config, first_recipe: str) -> SimpleNamespace:
    with gr.Row():
        recipe = gr.Dropdown(studio.picker_choices(), value=first_recipe, label="recipe", elem_id="recipe",
                             info="hardware, and the verdict and hours of its last plan")
        yaml_path = gr.Textbox(label="or a YAML file (path)", elem_id="yaml-path",
                               info="a recipe file of your own; Enter loads it")
    card = gr.Markdown(studio.recipe_card(first_recipe, ""), elem_id="recipe-card")
    error = gr.Markdown(elem_id="recipe-error")
    command = gr.Code(label="the command that trains it", language="shell", elem_id="command")
    extra = gr.Textbox(label="more overrides (key=value, one a line)", lines=2, elem_id="extra-overrides",
                       info="any key, as on the command line; a misspelt one is named with the nearest")
    values = studio.form_for(base)
    fields = []
    for section in dict.fromkeys(f.section for f in studio.fields):
        with gr.Accordion(section, open=section in ("train", "data")):
            fields += [field_component(f, values[i]) for i, f in enumerate(studio.fields) if f.section == section]
    config_yaml = gr.Code(label="the resolved config (YAML)", language="yaml", elem_id="config-yaml")
    return SimpleNamespace(recipe=recipe, yaml_path=yaml_path, card=card, error=error, command=command, extra=extra,
                           fields=fields, config_yaml=config_yaml, shown=gr.State(first_recipe))


def plan_tab() -> SimpleNamespace:
    status = gr.Markdown(elem_id="plan-status")
    memory = gr.Plot(elem_id="memory-plot", show_label=False)
    timing = gr.Plot(elem_id="time-plot", show_label=False)
    note = gr.Markdown(elem_id="levers-note")
    buttons = [gr.Button(visible=False, elem_id=f"lever-{i}", size="sm") for i in range(MAX_LEVERS)]
    text = gr.Code(label="the plan as --plan prints it", elem_id="plan-text")
    return SimpleNamespace(status=status, memory=memory, timing=timing, note=note, buttons=buttons, text=text,
                           levers=gr.State([]))


def run_tab(base: Config) -> SimpleNamespace:
    with gr.Row():
        ranks = gr.Number(value=default_ranks(base), precision=0, label="ranks (GPUs, or CPU processes)",
                          elem_id="ranks")
        launch = gr.Button("Launch", variant="primary", elem_id="launch")
        stop = gr.Button("Stop (keeps a checkpoint)", variant="stop", elem_id="stop")
        resume = gr.Button("Resume", elem_id="resume")
    with gr.Row():
        folders = gr.Dropdown([], value=None, allow_custom_value=True, elem_id="run-folders", scale=4,
                              label="or follow a run under outputs/ (or type any run folder)",
                              info="started here, in a terminal or before a restart: its curves and progress")
        list_runs = gr.Button("List runs", size="sm", elem_id="list-runs", scale=1)
    return SimpleNamespace(
        ranks=ranks, launch=launch, stop=stop, resume=resume, folders=folders, list_runs=list_runs,
        error=gr.Markdown(elem_id="run-error"),
        status=gr.Markdown(elem_id="run-status"), progress=gr.Markdown(elem_id="run-progress"),
        curves=gr.Plot(elem_id="curves-plot", show_label=False),
        completions=gr.Dataframe(headers=["step", "prompt", "completion", "reward"], label="latest completions",
                                 elem_id="completions", wrap=True),
        log=gr.Textbox(label="log (last lines)", lines=10, max_lines=10, elem_id="run-log", autoscroll=True))


def after_tab() -> SimpleNamespace:
    choices = [*adapters_under(RUNS_ROOT), BASE_MODEL]
    with gr.Row():
        adapter = gr.Dropdown(choices, value=choices[0], allow_custom_value=True, label="adapter", elem_id="adapter")
        adapter_b = gr.Dropdown(choices, value=BASE_MODEL, allow_custom_value=True, label="second adapter (compare)",
                                elem_id="adapter-b")
        find = gr.Button("Find adapters", size="sm", elem_id="find-adapters")
    with gr.Row():
        sampling = [gr.Number(value=64, precision=0, label="max new tokens", elem_id="max-new-tokens"),
                    gr.Number(value=0.0, label="temperature (0: greedy)", elem_id="temperature"),
                    gr.Number(value=1.0, label="top-p", elem_id="top-p")]
    chatbot = gr.Chatbot(label="chat", elem_id="chatbot", height=300)
    prompt = gr.Textbox(label="prompt (Enter sends)", elem_id="prompt")
    compare = gr.Button("Compare the two adapters on this prompt", elem_id="compare")
    with gr.Row():
        replies = [gr.Textbox(label="adapter", lines=4, elem_id="reply-a"),
                   gr.Textbox(label="second adapter", lines=4, elem_id="reply-b")]
    error = gr.Markdown(elem_id="after-error")
    with gr.Row():
        merge_out = gr.Textbox(label="merge into (new folder)", elem_id="merge-out")
        merge = gr.Button("Merge", elem_id="merge")
        gguf_out = gr.Textbox(label="GGUF into (new folder)", elem_id="gguf-out")
        gguf_type = gr.Dropdown(list(GGUF_TYPES), value=default_gguf_type(), label="GGUF type", elem_id="gguf-type")
        ollama_name = gr.Textbox(label="Ollama name (optional)", elem_id="ollama-name",
                                 info="runs `ollama create NAME` where ollama is installed; else prints it")
        export = gr.Button("Export GGUF", elem_id="export")
    sizes = gr.Markdown(elem_id="export-sizes")
    output = gr.Textbox(label="merge / export", lines=8, elem_id="tool-output")
    return SimpleNamespace(adapter=adapter, adapter_b=adapter_b, find=find, sampling=sampling, chatbot=chatbot,
                           prompt=prompt, compare=compare, replies=replies, error=error, merge_out=merge_out,
                           merge=merge, gguf_out=gguf_out, gguf_type=gguf_type, ollama_name=ollama_name,
                           export=export, sizes=sizes, output=output)


def build_page(studio: Studio, first_recipe: str = "tiny_cpu") -> gr.Blocks:
    base, _ = studio.load_recipe(first_recipe)
    assert base is not None, f"the starting recipe {first_recipe} must load"
    with gr.Blocks(title="qlora-fsdp studio", analytics_enabled=False) as page:
        gr.Markdown("# qlora-fsdp studio\nThe command line's recipes, plan, training and tools, on this machine.")
        with gr.Tab("Recipe"):
            recipe = recipe_tab(studio, base, first_recipe)
        with gr.Tab("Data"):
            data = data_tab(base)
        with gr.Tab("Plan"):
            plan = plan_tab()
        with gr.Tab("Run"):
            run = run_tab(base)
        with gr.Tab("Hardware"):
            hw = hardware_tab()
        with gr.Tab("After"):
            after = after_tab()
        # outside the tabs: a timer inside one ticks only once that tab has been opened
        run.timer, run.interval = gr.Timer(IDLE_TICK_S), gr.State(IDLE_TICK_S)
        recipe.ranks = run.ranks  # the launch's ranks are the plan's world: a recipe input like the form's
        wire_recipe(studio, page, recipe, plan, run)
        wire_plan(studio, recipe, plan)
        wire_data(studio, recipe, data, plan)
        run_part = wire_run(studio, page, recipe, run, after, hw)
        wire_ticks(run.timer, run.interval, [run_part, hardware_tick(studio, hw, studio.shown_run)],
                   lambda: (shown := studio.shown_run()) is not None and shown.running)
        wire_after(studio, page, recipe, after)
    return page


def serve(studio: Studio, host: str, port: int, recipe: str = "tiny_cpu") -> gr.Blocks:
    """Start the page's server (returns at once; `page.close()` ends it)."""
    page = build_page(studio, recipe)
    # _frontend=False: Gradio's own check that the port answers (a few seconds) would end the page on a loaded
    # machine with a message about share links; the command checks it with more patience and only warns
    page.queue(default_concurrency_limit=4).launch(server_name=host, server_port=port, prevent_thread_lock=True,
                                                   quiet=True, css=CSS, show_error=True, _frontend=False)
    return page


def answers(url: str, seconds: float = 30.0) -> bool:
    """Whether the page answers at `url` within `seconds` (a loaded machine can take a while)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
