"""The studio's page, laid out in Gradio: Recipe (picker, schema form, YAML, command), Plan (pictures and levers),
Run (launch, curves, completions, stop, resume) and After (chat, compare, merge, GGUF). Each action calls
session.py; nothing here computes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home from a local page

import gradio as gr  # noqa: E402

from qlora_fsdp.studio.chat import BASE_MODEL, Settings, run_tool, tool_command  # noqa: E402
from qlora_fsdp.studio.draft import default_ranks, shipped_recipes  # noqa: E402
from qlora_fsdp.studio.pictures import curves_figure, memory_figure, time_figure  # noqa: E402
from qlora_fsdp.studio.session import Studio, adapters_under  # noqa: E402

MAX_LEVERS = 8
TICK_S = 2.0
CSS = ".error-line {color: #b91c1c; font-weight: 600} .fits {color: #15803d}"


def error_markdown(line: str) -> str:
    return f"<span class='error-line'>{line}</span>" if line else ""


def field_component(field: Any, value: Any) -> gr.components.Component:
    common = {"label": field.key, "info": field.help, "elem_id": field.element_id}
    if field.kind == "bool":
        return gr.Checkbox(value=value, **common)
    if field.kind == "choice":
        return gr.Dropdown(choices=list(field.choices), value=value, allow_custom_value=False, **common)
    return gr.Textbox(value=value, lines=1, max_lines=4, **common)


def build_page(studio: Studio, first_recipe: str = "tiny_cpu") -> gr.Blocks:
    base, _ = studio.load_recipe(first_recipe)
    assert base is not None, f"the starting recipe {first_recipe} must load"
    with gr.Blocks(title="qlora-fsdp studio", analytics_enabled=False) as page:
        gr.Markdown("# qlora-fsdp studio\nThe command line's recipes, plan, training and tools, on this machine.")
        with gr.Tab("Recipe", id="tab-recipe"):
            with gr.Row():
                recipe = gr.Dropdown(shipped_recipes(), value=first_recipe, label="recipe", elem_id="recipe")
                yaml_path = gr.Textbox(label="or a YAML file (path)", elem_id="yaml-path",
                                       info="a recipe file of your own; Enter loads it")
            recipe_error = gr.Markdown(elem_id="recipe-error")
            command = gr.Code(label="the command that trains it", language="shell", elem_id="command")
            extra = gr.Textbox(label="more overrides (key=value, one a line)", lines=2, elem_id="extra-overrides",
                               info="any key, as on the command line; a misspelt one is named with the nearest")
            fields = []
            for section in dict.fromkeys(f.section for f in studio.fields):
                with gr.Accordion(section, open=section in ("train", "data")):
                    for field in (f for f in studio.fields if f.section == section):
                        fields.append(field_component(field, studio.form_for(base)[studio.fields.index(field)]))
            config_yaml = gr.Code(label="the resolved config (YAML)", language="yaml", elem_id="config-yaml")
        with gr.Tab("Plan", id="tab-plan"):
            plan_status = gr.Markdown(elem_id="plan-status")
            memory_plot = gr.Plot(label="memory by component, against the card's size", elem_id="memory-plot")
            time_plot = gr.Plot(label="an optimizer step's time", elem_id="time-plot")
            gr.Markdown("Levers that make it fit (one click applies one):")
            lever_buttons = [gr.Button(visible=False, elem_id=f"lever-{i}", size="sm") for i in range(MAX_LEVERS)]
            levers_state = gr.State([])
            plan_text = gr.Code(label="the plan as --plan prints it", elem_id="plan-text")
        with gr.Tab("Run", id="tab-run"):
            with gr.Row():
                ranks = gr.Number(value=default_ranks(base), precision=0, label="ranks (GPUs, or CPU processes)",
                                  elem_id="ranks")
                launch = gr.Button("Launch", variant="primary", elem_id="launch")
                stop = gr.Button("Stop (keeps a checkpoint)", variant="stop", elem_id="stop")
                resume = gr.Button("Resume", elem_id="resume")
            run_error = gr.Markdown(elem_id="run-error")
            run_status = gr.Markdown(elem_id="run-status")
            run_progress = gr.Markdown(elem_id="run-progress")
            curves_plot = gr.Plot(label="curves", elem_id="curves-plot")
            completions = gr.Dataframe(headers=["step", "prompt", "completion", "reward"], label="latest completions",
                                       elem_id="completions", wrap=True)
            log = gr.Textbox(label="log (last lines)", lines=10, max_lines=10, elem_id="run-log", autoscroll=True)
            timer = gr.Timer(TICK_S, active=True)
        with gr.Tab("After", id="tab-after"):
            choices = [*adapters_under(Path("outputs")), BASE_MODEL]
            with gr.Row():
                adapter = gr.Dropdown(choices, value=choices[0], allow_custom_value=True, label="adapter",
                                      elem_id="adapter")
                adapter_b = gr.Dropdown(choices, value=BASE_MODEL, allow_custom_value=True,
                                        label="second adapter (compare)", elem_id="adapter-b")
                refresh_adapters = gr.Button("Find adapters", size="sm", elem_id="find-adapters")
            with gr.Row():
                max_new = gr.Number(value=64, precision=0, label="max new tokens", elem_id="max-new-tokens")
                temperature = gr.Number(value=0.0, label="temperature (0: greedy)", elem_id="temperature")
                top_p = gr.Number(value=1.0, label="top-p", elem_id="top-p")
            chatbot = gr.Chatbot(label="chat", elem_id="chatbot", height=300)
            prompt = gr.Textbox(label="prompt (Enter sends)", elem_id="prompt")
            compare = gr.Button("Compare the two adapters on this prompt", elem_id="compare")
            with gr.Row():
                reply_a = gr.Textbox(label="adapter", lines=4, elem_id="reply-a")
                reply_b = gr.Textbox(label="second adapter", lines=4, elem_id="reply-b")
            after_error = gr.Markdown(elem_id="after-error")
            with gr.Row():
                merge_out = gr.Textbox(label="merge into (new folder)", elem_id="merge-out")
                merge = gr.Button("Merge", elem_id="merge")
                gguf_out = gr.Textbox(label="GGUF into (new folder)", elem_id="gguf-out")
                gguf_type = gr.Dropdown(["f16", "bf16", "q8_0", "f32"], value="f16", label="GGUF type")
                export = gr.Button("Export GGUF", elem_id="export")
            tool_output = gr.Textbox(label="merge / export", lines=4, elem_id="tool-output")

        recipe_inputs = [recipe, yaml_path, extra, *fields]

        def resolved_of(recipe_name: str, path: str, extra_text: str, *values: Any) -> Any:
            return studio.resolved(studio.recipe_of(recipe_name, path), list(values), extra_text)

        def refresh(*inputs: Any) -> tuple[Any, ...]:
            resolved = resolved_of(*inputs)
            return error_markdown(resolved.error), studio.command(resolved), resolved.yaml

        def load(recipe_name: str, path: str) -> tuple[Any, ...]:
            cfg, error = studio.load_recipe(studio.recipe_of(recipe_name, path))
            if cfg is None:  # the form keeps what it held; the error says why
                return (error_markdown(error), "", *[gr.skip()] * len(fields), gr.skip())
            return ("", "", *studio.form_for(cfg), default_ranks(cfg))

        def plan(*inputs: Any) -> Any:
            yield ("planning...", gr.skip(), gr.skip(), gr.skip(), gr.skip(), *[gr.skip()] * MAX_LEVERS)
            data = studio.plan(resolved_of(*inputs))
            if data is None:  # superseded by a newer plan: that one draws
                return
            if "error" in data:
                yield (error_markdown(data["error"]), None, None, "", [], *[gr.update(visible=False)] * MAX_LEVERS)
                return
            levers = data["levers"][:MAX_LEVERS]
            verdict = "FITS" if data["fits"] else "DOES NOT FIT"
            status = f"**{verdict}**: {data['description']}" + ("" if data["fits"] or levers else
                                                                    " (no single change makes it fit)")
            buttons = [gr.update(visible=True, value=f"{lv['label']}: {lv['gpu_gib']:.1f} GiB{lv['cost']}")
                       for lv in levers] + [gr.update(visible=False)] * (MAX_LEVERS - len(levers))
            timing = time_figure(data)
            if timing is None:
                status += "<br>no step time: a CPU recipe has no rates to price it with (GPU recipes do)"
            yield (status, memory_figure(data), gr.update(value=timing, visible=timing is not None), data["text"],
                   levers, *buttons)

        plan_outputs = [plan_status, memory_plot, time_plot, plan_text, levers_state, *lever_buttons]
        recipe_outputs = [recipe_error, command, config_yaml]
        edits = [extra.blur, extra.submit]  # text: when the user leaves the box or presses Enter, not every key
        for component in fields:
            if isinstance(component, gr.Textbox):
                edits += [component.blur, component.submit]
            else:  # a checkbox or a drop-down: each pick is one edit
                edits.append(component.input)  # type: ignore[attr-defined]
        loaded = gr.on([recipe.input, yaml_path.submit], load, [recipe, yaml_path],
                       [recipe_error, extra, *fields, ranks])
        loaded.then(refresh, recipe_inputs, recipe_outputs).then(plan, recipe_inputs, plan_outputs,
                                                                 concurrency_limit=None)
        gr.on(edits, refresh, recipe_inputs, recipe_outputs, trigger_mode="always_last").then(
            plan, recipe_inputs, plan_outputs, concurrency_limit=None)
        page.load(refresh, recipe_inputs, recipe_outputs).then(plan, recipe_inputs, plan_outputs,
                                                               concurrency_limit=None)

        def apply_lever(index: int) -> Any:
            def apply(levers: list[dict[str, Any]], *values: Any) -> tuple[Any, ...]:
                changes = levers[index]["overrides"] if index < len(levers) else {}
                out = list(values)
                for i, field in enumerate(studio.fields):
                    if field.key in changes:
                        value = changes[field.key]
                        out[i] = value if field.kind == "bool" else str(value).lower() if isinstance(value, bool) \
                            else str(value)
                return tuple(out)
            return apply

        for i, button in enumerate(lever_buttons):
            button.click(apply_lever(i), [levers_state, *fields], fields).then(
                refresh, recipe_inputs, recipe_outputs).then(plan, recipe_inputs, plan_outputs,
                                                             concurrency_limit=None)

        def start(resumed: bool) -> Any:
            def go(ranks_value: float, *inputs: Any) -> tuple[Any, Any]:
                resolved = resolved_of(*inputs)
                try:
                    if resolved.config is None:
                        return error_markdown(resolved.error), gr.skip()
                    run = studio.runs.launch(resolved.draft, int(ranks_value), resume=resumed)
                except Exception as err:  # a UserError's words; anything else as it is
                    return error_markdown(f"error: {err}"), gr.skip()
                return "", run.status()
            return go

        launch.click(start(False), [ranks, *recipe_inputs], [run_error, run_status])
        resume.click(start(True), [ranks, *recipe_inputs], [run_error, run_status])

        def stop_run() -> tuple[str, str]:
            try:
                return "", studio.runs.stop().status()
            except Exception as err:
                return error_markdown(f"error: {err}"), gr.skip()

        stop.click(stop_run, None, [run_error, run_status])

        def tick() -> tuple[Any, ...]:
            view = studio.run_view()
            new_adapter = studio.new_adapter()  # a run that just finished: its adapter, ready to chat with
            pick = gr.update(choices=[new_adapter, *adapters_under(Path("outputs")), BASE_MODEL],
                             value=new_adapter) if new_adapter else gr.skip()
            if not view.changed:
                return view.status, gr.skip(), gr.skip(), gr.skip(), view.log, pick
            return (view.status, view.progress.words(), curves_figure(view.series), view.completions or None,
                    view.log, pick)

        timer.tick(tick, None, [run_status, run_progress, curves_plot, completions, log, adapter])

        def settings(max_tokens: float, temp: float, p: float) -> Settings:
            return Settings(int(max_tokens or 64), float(temp or 0.0), float(p or 1.0))

        def chat(message: str, history: list[dict[str, Any]], adapter_path: str, max_tokens: float, temp: float,
                 p: float, *inputs: Any) -> Any:
            if not message.strip():
                return
            history = [*history, {"role": "user", "content": message}, {"role": "assistant", "content": ""}]
            try:
                worker = studio.chats.worker(adapter_path, studio.recipe_of(*inputs[:2]))
                for text in worker.stream(message, settings(max_tokens, temp, p)):
                    history[-1] = {"role": "assistant", "content": text}
                    yield history, "", ""
            except Exception as err:
                yield history[:-2], message, error_markdown(f"error: {err}")

        chat_inputs = [prompt, chatbot, adapter, max_new, temperature, top_p, recipe, yaml_path]
        prompt.submit(chat, chat_inputs, [chatbot, prompt, after_error])

        def side_by_side(message: str, first: str, second: str, max_tokens: float, temp: float, p: float,
                         *inputs: Any) -> Any:
            replies = ["", ""]
            try:
                for side, path in enumerate((first, second)):
                    worker = studio.chats.worker(path, studio.recipe_of(*inputs[:2]))
                    for text in worker.stream(message, settings(max_tokens, temp, p)):
                        replies[side] = text
                        yield replies[0], replies[1], ""
            except Exception as err:
                yield replies[0], replies[1], error_markdown(f"error: {err}")

        compare.click(side_by_side, [prompt, adapter, adapter_b, max_new, temperature, top_p, recipe, yaml_path],
                      [reply_a, reply_b, after_error])

        def tool(kind: str) -> Any:
            def go(adapter_path: str, out: str, outtype: str) -> tuple[str, str]:
                try:
                    extra_args = ["--outtype", outtype] if kind == "export" else []
                    ok, text = run_tool(tool_command(kind, adapter_path, out, extra_args))
                except Exception as err:
                    return f"error: {err}", ""
                return ("", text) if ok else (error_markdown(text), text)
            return go

        merge.click(tool("merge"), [adapter, merge_out, gguf_type], [after_error, tool_output])
        export.click(tool("export"), [adapter, gguf_out, gguf_type], [after_error, tool_output])

        def find() -> tuple[Any, Any]:
            found = [*adapters_under(Path("outputs")), BASE_MODEL]
            return gr.update(choices=found, value=found[0]), gr.update(choices=found)

        refresh_adapters.click(find, None, [adapter, adapter_b])
    return page


def serve(studio: Studio, host: str, port: int, recipe: str = "tiny_cpu") -> gr.Blocks:
    """Start the page's server (returns at once; `page.close()` ends it)."""
    page = build_page(studio, recipe)
    page.queue(default_concurrency_limit=4).launch(server_name=host, server_port=port, prevent_thread_lock=True,
                                                   quiet=True, css=CSS, show_error=True)
    return page
