"""What the page's components do when used: each handler reads the components it needs, calls the session
(session.py) and fills the components it changes. The layout is app.py's."""

from __future__ import annotations

import html
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gradio as gr

from qlora_fsdp.studio.chat import BASE_MODEL, Settings, run_tool, tool_command
from qlora_fsdp.studio.draft import default_ranks
from qlora_fsdp.studio.export_view import sizes_line
from qlora_fsdp.studio.pictures import curves_figure, memory_figure, time_figure
from qlora_fsdp.studio.plan_worker import PlanData
from qlora_fsdp.studio.session import Studio, adapters_under, run_choices
from qlora_fsdp.studio.ticks import TickPart, fast

MAX_LEVERS = 8  # lever buttons the Plan tab holds (a plan offers fewer)
RUNS_ROOT = Path("outputs")  # where the After tab looks for adapters
EVERY_EDIT = "multiple"  # each edit runs its event, even while the plan of an earlier one runs


def error_markdown(line: str) -> str:
    """An error line as the page shows it: its text escaped (YAML's `<stream end>` is words, not a tag)."""
    return f"<span class='error-line'>{html.escape(line)}</span>" if line else ""


def plan_outputs(data: PlanData | None) -> Any:
    """The Plan tab's components for a plan: its status, pictures, text, levers (buttons) and their note."""
    if data is None:  # superseded by a newer plan: that one draws
        return None
    if "error" in data:
        return (error_markdown(data["error"]), None, gr.update(value=None, visible=False), "", [], "",
                *[gr.update(visible=False)] * MAX_LEVERS)
    levers = data["levers"][:MAX_LEVERS]
    run_time = f"; the run: **{data['run_time']}**" if data.get("run_time") else ""
    status = f"**{'FITS' if data['fits'] else 'DOES NOT FIT'}**{run_time}: {data['description']}"
    if not data["fits"] and not levers:
        status += " (no single change makes it fit: combine them, or use more GPUs)"
    timing = time_figure(data)
    if timing is None:
        status += "<br>no step time: a CPU recipe has no rates to price it with (GPU recipes do)"
    note = "Changes that make it fit, most throughput kept first (a click applies one):" if levers else ""
    buttons = [gr.update(visible=True, value=f"{lv['label']}: {lv['gpu_gib']:.1f} GiB{lv['cost']}")
               for lv in levers] + [gr.update(visible=False)] * (MAX_LEVERS - len(levers))
    return (status, memory_figure(data), gr.update(value=timing, visible=timing is not None), data["text"], levers,
            note, *buttons)


def recipe_inputs(recipe: SimpleNamespace) -> list[Any]:
    return [recipe.recipe, recipe.yaml_path, recipe.extra, recipe.ranks, *recipe.fields]


def plan_components(plan: SimpleNamespace) -> list[Any]:
    return [plan.status, plan.memory, plan.timing, plan.text, plan.levers, plan.note, *plan.buttons]


def resolved_of(studio: Studio, recipe_name: str, path: str, extra: str, ranks: float | None, *values: Any) -> Any:
    return studio.resolved(studio.recipe_of(recipe_name or "", path), list(values), extra, int(ranks or 0) or None)


def then_refresh_and_plan(studio: Studio, event: Any, recipe: SimpleNamespace, plan: SimpleNamespace) -> None:
    """After `event`: the YAML, the command and the error line at once, then the plan (in its worker; a newer
    request ends an older one, so the plan event runs unqueued, and each step runs for every edit: Gradio's
    default would skip an edit made while the previous plan runs)."""
    def refresh(*inputs: Any) -> tuple[Any, ...]:
        resolved = resolved_of(studio, *inputs)
        if resolved.config is None:
            return error_markdown(resolved.error), "", "", gr.skip()
        # the ranks box shows the world the draft plans (a `hardware.gpus_per_node` the user set wins over it)
        return "", studio.command(resolved), resolved.yaml, resolved.config.hardware.gpus_per_node

    def replan(*inputs: Any) -> Any:
        yield ("planning...", *[gr.skip()] * (len(plan_components(plan)) - 1), gr.skip())
        shown = plan_outputs(studio.plan(resolved_of(studio, *inputs)))
        if shown is not None:
            yield (*shown, studio.recipe_card(*inputs[:2]))

    # one refresh at a time, in the order of the edits: run side by side, an older one could land last and show
    # a draft without the newer edit
    refreshed = event.then(refresh, recipe_inputs(recipe),
                           [recipe.error, recipe.command, recipe.config_yaml, recipe.ranks],
                           trigger_mode=EVERY_EDIT, concurrency_limit=1, concurrency_id="refresh")
    refreshed.then(replan, recipe_inputs(recipe), [*plan_components(plan), recipe.card], concurrency_limit=None,
                   trigger_mode=EVERY_EDIT)


def wire_recipe(studio: Studio, page: gr.Blocks, recipe: SimpleNamespace, plan: SimpleNamespace,
                run: SimpleNamespace) -> None:
    def load(recipe_name: str, path: str, shown: str) -> tuple[Any, ...]:
        cfg, error, shown = studio.shown_recipe(recipe_name, path, shown)
        card = studio.recipe_card(recipe_name, path)
        if cfg is None:  # the form keeps what it held (the user's edits); an error says why
            return (error_markdown(error), gr.skip(), *[gr.skip()] * len(recipe.fields), gr.skip(), shown, card)
        return ("", "", *studio.form_for(cfg), default_ranks(cfg), shown, card)

    picked = [recipe.recipe, recipe.yaml_path, recipe.shown]
    loaded = gr.on([recipe.recipe.input, recipe.yaml_path.submit], load, picked,
                   [recipe.error, recipe.extra, *recipe.fields, run.ranks, recipe.shown, recipe.card],
                   trigger_mode=EVERY_EDIT)
    edits = [recipe.extra.blur, recipe.extra.submit, run.ranks.blur, run.ranks.submit]  # text: on leaving, or Enter
    for component in recipe.fields:
        if isinstance(component, gr.Textbox):
            edits += [component.blur, component.submit]
        else:  # a checkbox or a drop-down: each pick is one edit
            edits.append(component.input)
    edited = gr.on(edits, lambda: None, None, None, trigger_mode=EVERY_EDIT)
    opened = page.load(lambda: gr.update(choices=studio.picker_choices()), None, recipe.recipe)
    for event in (loaded, edited, opened):
        then_refresh_and_plan(studio, event, recipe, plan)


def wire_plan(studio: Studio, recipe: SimpleNamespace, plan: SimpleNamespace) -> None:
    def apply_lever(index: int) -> Any:
        def apply(levers: list[dict[str, Any]], extra: str, *values: Any) -> tuple[Any, ...]:
            changes = levers[index]["overrides"] if index < len(levers) else {}
            form, kept = studio.with_lever(changes, list(values), extra)
            return (kept, *form)
        return apply

    for index, button in enumerate(plan.buttons):
        clicked = button.click(apply_lever(index), [plan.levers, recipe.extra, *recipe.fields],
                               [recipe.extra, *recipe.fields])
        then_refresh_and_plan(studio, clicked, recipe, plan)


def wire_run(studio: Studio, page: gr.Blocks, recipe: SimpleNamespace, run: SimpleNamespace,
             after: SimpleNamespace, hw: SimpleNamespace) -> TickPart:
    """Launch, Stop, Resume and following a run; returns the Run tab's share of the timer's tick."""
    def start(resume: bool) -> Any:
        def go(gpus: list[int] | None, *inputs: Any) -> tuple[Any, ...]:
            resolved = resolved_of(studio, *inputs)
            try:
                if resolved.config is None:
                    return error_markdown(resolved.error), gr.skip(), gr.skip(), gr.skip()
                ranks = resolved.config.hardware.gpus_per_node  # the ranks box's, folded into the draft
                launched = studio.launch(resolved.draft, ranks, resume, hw.monitor.visible(gpus or []))
                hw.monitor.follow(launched)  # the sampler starts with the run, whether a page looks or not
                return "", launched.status(), *fast()
            except Exception as err:  # a UserError's words; anything else as it is
                return error_markdown(f"error: {err}"), gr.skip(), gr.skip(), gr.skip()
        return go

    paced = [run.error, run.status, run.timer, run.interval]
    run.launch.click(start(False), [hw.gpus, *recipe_inputs(recipe)], paced)
    run.resume.click(start(True), [hw.gpus, *recipe_inputs(recipe)], paced)
    wire_follow(studio, page, run)

    def stop() -> tuple[Any, Any]:
        try:
            return "", studio.runs.stop().status()
        except Exception as err:
            return error_markdown(f"error: {err}"), gr.skip()

    run.stop.click(stop, None, [run.error, run.status])

    def tick(seen: str) -> tuple[Any, ...]:
        view = studio.run_view(seen)
        finished = studio.new_adapter()  # a run that just finished: its adapter, ready to chat with
        pick = gr.update(choices=[finished, *adapters_under(RUNS_ROOT), BASE_MODEL], value=finished) \
            if finished else gr.skip()
        if not view.changed:  # the curves are drawn again only when the run wrote more
            return view.status, gr.skip(), gr.skip(), gr.skip(), view.log, pick, seen
        return (view.status, view.progress.words(), curves_figure(view.series), view.completions or None, view.log,
                pick, view.seen)

    seen = gr.State("")  # this page's last look at the metrics file
    return TickPart(tick, [seen], [run.status, run.progress, run.curves, run.completions, run.log, after.adapter, seen])


def wire_follow(studio: Studio, page: gr.Blocks, run: SimpleNamespace) -> None:
    """The runs under outputs/ (whoever started them), listed when the page opens and on request; picking one,
    or typing any run folder, shows it in place of the page's own run."""
    def listed() -> Any:
        return gr.update(choices=run_choices(RUNS_ROOT))

    def follow(folder: str | None) -> tuple[Any, ...]:
        if not folder:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        error = studio.follow(folder)
        run_now = studio.shown_run()
        if error or run_now is None:
            return error_markdown(error), gr.skip(), gr.skip(), gr.skip()
        return "", run_now.status(), *fast()

    page.load(listed, None, run.folders)
    run.list_runs.click(listed, None, run.folders)
    run.folders.input(follow, run.folders, [run.error, run.status, run.timer, run.interval])


def settings(max_tokens: float, temperature: float, top_p: float) -> Settings:
    return Settings(int(max_tokens or 64), float(temperature or 0.0), float(top_p or 1.0))


def wire_after(studio: Studio, page: gr.Blocks, recipe: SimpleNamespace, after: SimpleNamespace) -> None:
    def chat(message: str, history: list[dict[str, Any]], adapter: str, *rest: Any) -> Any:
        if not message.strip():
            return
        history = [*history, {"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        try:
            worker = studio.chats.worker(adapter, studio.recipe_of(*rest[3:5]))
            for text in worker.stream(message, settings(*rest[:3])):
                history[-1] = {"role": "assistant", "content": text}
                yield history, "", ""
        except Exception as err:
            yield history[:-2], message, error_markdown(f"error: {err}")

    picked = [recipe.recipe, recipe.yaml_path]
    after.prompt.submit(chat, [after.prompt, after.chatbot, after.adapter, *after.sampling, *picked],
                        [after.chatbot, after.prompt, after.error])

    def compare(message: str, first: str, second: str, *rest: Any) -> Any:
        if not message.strip():
            yield "", "", error_markdown("error: type a prompt to compare the two on (Enter would send it to the chat)")
            return
        replies = ["", ""]
        try:
            for side, adapter in enumerate((first, second)):
                worker = studio.chats.worker(adapter, studio.recipe_of(*rest[3:5]))
                for text in worker.stream(message, settings(*rest[:3])):
                    replies[side] = text
                    yield replies[0], replies[1], ""
        except Exception as err:
            yield replies[0], replies[1], error_markdown(f"error: {err}")

    after.compare.click(compare, [after.prompt, after.adapter, after.adapter_b, *after.sampling, *picked],
                        [*after.replies, after.error])
    wire_tools(page, after)


def wire_tools(page: gr.Blocks, after: SimpleNamespace) -> None:
    def tool(kind: str) -> Any:
        def go(adapter: str, out: str, outtype: str, ollama_name: str) -> tuple[str, str]:
            try:
                extra = ["--outtype", outtype] if kind == "export" else []
                if kind == "export" and ollama_name.strip():
                    extra += ["--ollama-create", ollama_name.strip()]
                ok, text = run_tool(tool_command(kind, adapter, out, extra))
            except Exception as err:
                return error_markdown(f"error: {err}"), ""
            return ("", text) if ok else (error_markdown(text), text)
        return go

    tool_inputs = [after.gguf_type, after.ollama_name]
    after.merge.click(tool("merge"), [after.adapter, after.merge_out, *tool_inputs], [after.error, after.output])
    after.export.click(tool("export"), [after.adapter, after.gguf_out, *tool_inputs], [after.error, after.output])
    # the sizes before anything is written, for the adapter and the type shown (also when the page picks one)
    gr.on([after.adapter.change, after.gguf_type.change, page.load], sizes_line, [after.adapter, after.gguf_type],
          after.sizes)

    def find() -> tuple[Any, Any]:
        found = [*adapters_under(RUNS_ROOT), BASE_MODEL]
        return gr.update(choices=found, value=found[0]), gr.update(choices=found)

    after.find.click(find, None, [after.adapter, after.adapter_b])
    page.load(find, None, [after.adapter, after.adapter_b])  # a page opened later lists what was written since
