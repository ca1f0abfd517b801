"""The studio's page data, without a browser: the form generated from the schema, the draft and its command, the
run's files read while written, the plan's pictures, the launch refusals; then (slow: processes) the plan worker
against `--plan`, a superseded plan, a lever applied, and the chat worker against qlora-generate."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qlora_fsdp.config import RECIPES_DIR, load_config, to_yaml
from qlora_fsdp.config.reference import render
from qlora_fsdp.errors import UserError
from qlora_fsdp.studio.draft import Draft, extra_overrides, resolve, torchrun_command
from qlora_fsdp.studio.form import changed_overrides, form_fields, form_values
from qlora_fsdp.studio.live import complete_records, curves, latest_completions, progress
from qlora_fsdp.studio.pictures import curves_figure, memory_bars, memory_figure, time_figure
from qlora_fsdp.studio.runs import refuse_launch

ROOT = Path(__file__).resolve().parents[1]


def test_the_form_holds_every_key_of_the_reference_with_its_choices_and_a_recipe_round_trips():
    fields = form_fields()
    keys = {f.key for f in fields}
    documented = {line.split("`")[1] for line in render().splitlines() if line.startswith("| `")}
    assert keys == {k for k in documented if "[]." not in k}  # data.sources[] items are edited as data.sources
    by_key = {f.key: f for f in fields}
    assert by_key["quant.quant_type"].choices == ("nf4", "fp4") and by_key["model.trust_remote_code"].kind == "bool"
    assert by_key["hardware.pcie_gen"].choices == ("3", "4", "5", "null")  # a Literal or None
    assert "paged_adamw_8bit" in by_key["optim.name"].choices  # a registry's names, not only Literals
    assert "optimizer steps to train for" in by_key["train.max_steps"].help
    for recipe in ("tiny_cpu", "qwen3_32b_2x4090_grpo", "qwen2.5_vl_7b_1x24gb_images"):
        cfg = load_config(recipe)
        values = form_values(cfg, fields)
        assert changed_overrides(cfg, fields, values) == []  # the recipe's own values are no override
        # every value the form shows is one the command line takes back unchanged
        again = load_config(recipe, [f"{f.key}={v}" if f.kind != "bool" else f"{f.key}={str(v).lower()}"
                                     for f, v in zip(fields, values, strict=True)])
        assert to_yaml(again) == to_yaml(cfg), recipe
    cfg = load_config("tiny_cpu")
    values = form_values(cfg, fields)
    index = {f.key: i for i, f in enumerate(fields)}
    values[index["train.max_steps"]] = "40"
    values[index["data.packing"]] = False
    values[index["lora.target_modules"]] = "[q_proj, v_proj]"
    overrides = changed_overrides(cfg, fields, values)
    assert overrides == ["lora.target_modules=[q_proj, v_proj]", "data.packing=false", "train.max_steps=40"]
    changed = load_config("tiny_cpu", overrides)
    assert (changed.train.max_steps, changed.data.packing, changed.lora.target_modules) == (40, False,
                                                                                          ["q_proj", "v_proj"])


def test_a_lever_sets_its_keys_in_the_form_and_the_form_then_means_them(tmp_path):
    from qlora_fsdp.studio.session import Studio

    studio = Studio(tmp_path)
    cfg = load_config("tiny_cpu")
    lever = {"activation_checkpointing.offload": True, "data.micro_batch_size": 2, "data.grad_accum_steps": 4,
             "activation_checkpointing.scope": "mlp"}
    values, extra = studio.with_lever(lever, studio.form_for(cfg), "data.micro_batch_size=8\noptim.lr=1e-4")
    assert extra == "optim.lr=1e-4"  # the lever's key leaves the free-text box, which would otherwise undo it
    draft = studio.draft("tiny_cpu", values, "")[0]
    assert sorted(draft.overrides) == ["activation_checkpointing.offload=true", "activation_checkpointing.scope=mlp",
                                       "data.grad_accum_steps=4", "data.micro_batch_size=2"]
    changed = load_config("tiny_cpu", list(draft.overrides))
    assert (changed.activation_checkpointing.offload, changed.data.micro_batch_size) == (True, 2)
    # a lever under a preset the user chose (the offload fix beside fsdp_preset=full_shard) plans what it promised
    chosen = load_config("llama70b_2x4090", ["fsdp_preset=full_shard"])
    values, extra = studio.with_lever({"fsdp.cpu_offload": True}, studio.form_for(chosen), "fsdp_preset=full_shard")
    draft = studio.draft("llama70b_2x4090", values, extra)[0]
    assert draft.overrides == ("fsdp_preset=full_shard", "fsdp.cpu_offload=true")
    assert load_config("llama70b_2x4090", list(draft.overrides)).fsdp.cpu_offload


def test_a_draft_resolves_to_the_command_lines_config_command_and_errors():
    draft = Draft("tiny_cpu", ("train.max_steps=40",)).with_overrides(["train.max_steps=7", "lora.r=4"])
    assert draft.overrides == ("train.max_steps=7", "lora.r=4")  # the last value of a key wins, as on the CLI
    resolved = resolve(draft)
    assert resolved.config is not None and resolved.config.train.max_steps == 7
    assert resolved.yaml == to_yaml(load_config("tiny_cpu", ["train.max_steps=7", "lora.r=4"]))
    assert torchrun_command(draft, 2) == ("torchrun --nproc_per_node 2 train.py --recipe tiny_cpu "
                                          "train.max_steps=7 lora.r=4")
    spaced = Draft("tiny_cpu", ("train.output_dir=out dir",))
    assert torchrun_command(spaced, 1).endswith("'train.output_dir=out dir'")  # pastes into a shell as is
    assert extra_overrides("a.b=1\n  # a note\n\nlora.target_modules=[q_proj, v_proj]  ") == [
        "a.b=1", "lora.target_modules=[q_proj, v_proj]"]
    errors = {resolve(Draft("tiny_cpu", ("train.max_stpes=3",))).error, resolve(Draft("nothere.yaml")).error,
              resolve(Draft("tiny_cpuu")).error}
    assert ("error: unknown key 'train.max_stpes' in the command-line overrides; did you mean 'train.max_steps'?"
            in errors)
    assert "error: recipe file not found: nothere.yaml" in errors
    assert any(e.startswith("error: unknown recipe 'tiny_cpuu': did you mean 'tiny_cpu'?") for e in errors)


def write_lines(path: Path, records: list[dict], tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_a_running_runs_files_are_read_by_complete_lines_as_curves_progress_and_completions(tmp_path):
    start = {"time": 100.0, "event": "start", "config": {"train": {"max_steps": 10}}}
    steps = [{"time": 100.0 + 2 * s, "step": s, "loss": 3.0 - s / 10, "tokens_per_s": 50.0} for s in (1, 2, 3, 4)]
    resume = {"time": 200.0, "event": "resume", "step": 2}
    again = [{"time": 200.0 + 5 * (s - 2), "step": s, "loss": 2.0 - s / 10, "tokens_per_s": 40.0} for s in (3, 4)]
    evaluated = {"time": 211.0, "step": 4, "eval_loss": 2.5}
    metrics = tmp_path / "metrics.jsonl"
    write_lines(metrics, [start, *steps, resume, *again, evaluated], tail='{"time": 212.0, "step": 5, "lo')
    records = complete_records(metrics)
    assert len(records) == 9  # the line being written is left for the next read
    series = curves(records)
    assert series["loss"] == [(1, 2.9), (2, 2.8), (3, 1.7), (4, 1.6)]  # the resumed run's steps replace the first's
    assert series["eval_loss"] == [(4, 2.5)] and series["tokens_per_s"][-1] == (4, 40.0)
    state = progress(records)
    assert (state.step, state.max_steps, state.seconds_a_step) == (4, 10, 5.0)  # since the resume
    assert state.seconds_left == 30.0 and state.latest["eval_loss"] == 2.5
    assert state.words() == "step 4/10 · loss 1.6 · eval_loss 2.5 · tokens_per_s 40 · about 30.0 s left"
    stopped = {"time": 300.0, "event": "summary", "stopped_by_signal": True}
    write_lines(metrics, [start, *steps, stopped])
    assert progress(complete_records(metrics)).words().endswith("stopped by a signal: resume to continue")
    # resumed after the stop: the time left again, not the stop
    resumed = {"time": 400.0, "event": "resume", "step": 4}
    write_lines(metrics, [start, *steps, stopped, resumed, {"time": 403.0, "step": 5, "loss": 1.0}])
    assert progress(complete_records(metrics)).words() == "step 5/10 · loss 1 · about 15.0 s left"
    assert complete_records(tmp_path / "none.jsonl") == [] and curves_figure(curves([])) is None
    figure = curves_figure(series)
    assert figure is not None and [ax.get_title() for ax in figure.axes if ax.get_visible()] == ["loss", "tokens/s"]
    completions = {"step": 3, "prompt": [{"role": "user", "content": "2+2?"}],
                   "completions": [[{"role": "assistant", "content": "4"}], "five"], "rewards": [1.0, 0.0]}
    write_lines(tmp_path / "completions.jsonl", [{**completions, "step": 1}, completions])
    assert latest_completions(tmp_path) == [[3, "user: 2+2?", "assistant: 4", 1.0], [3, "user: 2+2?", "five", 0.0]]


def test_the_plan_pictures_stack_every_component_against_the_cards():
    row = {"basis": "exact"}
    plan = {"fits": False, "capacity_gib": 24.0, "host_capacity_gib": 64.0, "description": "d",
            "gpu_rows": [{**row, "name": "4-bit base weights (shard)", "gib": 18.0},
                         {**row, "name": "activations (x)", "gib": 8.0}],
            "generating_rows": [{**row, "name": "KV cache", "gib": 10.0}],
            "host_rows": [{**row, "name": "processes", "gib": 3.0}],
            "time": {"compute": 2.0, "link (exposed after overlap)": 0.5, "optimizer": 0.1, "generation": 6.0,
                     "vision tower": 0.0, "total": 8.6}}
    bars = memory_bars(plan)
    assert [(name, sum(r["gib"] for r in rows), cap) for name, rows, cap in bars] == [
        ("GPU (update)", 26.0, 24.0), ("GPU (generating)", 10.0, 24.0), ("host RAM", 3.0, 64.0)]
    figure = memory_figure(plan)
    gpu_ax, host_ax = figure.axes
    assert gpu_ax.get_title(loc="left") == "DOES NOT FIT"
    assert sorted(round(p.get_width(), 3) for p in gpu_ax.patches) == [8.0, 10.0, 18.0]
    assert [round(p.get_width(), 3) for p in host_ax.patches] == [3.0]
    assert memory_bars({**plan, "capacity_gib": math.inf})[0][2] is None  # a CPU recipe: no card to draw
    timing = time_figure(plan)
    assert timing is not None and sum(p.get_width() for p in timing.axes[0].patches) == pytest.approx(8.6)
    assert time_figure({**plan, "time": None}) is None


def test_a_launch_into_a_used_folder_or_a_resume_of_nothing_is_refused_in_the_command_lines_words(tmp_path):
    out = tmp_path / "run"
    cfg = load_config("tiny_cpu", [f"train.output_dir={out}"])
    refuse_launch(cfg, resume=False)  # new folder: fine
    with pytest.raises(UserError, match="nothing to resume in .*: it holds no complete checkpoint"):
        refuse_launch(cfg, resume=True)
    (out / "checkpoints" / "step-000005").mkdir(parents=True)
    (out / "checkpoints" / "step-000005" / "trainer_state.json").write_text('{"step": 5}')
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match=r"already holds a run \(latest checkpoint step-000005\); resume it"):
        refuse_launch(cfg, resume=False)
    refuse_launch(load_config("tiny_cpu", [f"train.output_dir={out}", "train.resume=auto"]), resume=True)
    refuse_launch(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, overwrite=True)), resume=False)
    assert (out / "checkpoints" / "step-000005").is_dir()  # asking touched nothing
    from qlora_fsdp.studio.runs import Runs

    with pytest.raises(UserError, match=r"^ranks: 0: a run needs one process at least"):
        Runs(tmp_path / "logs").launch(Draft("tiny_cpu", (f"train.output_dir={tmp_path / 'new'}",)), 0)
    assert not (tmp_path / "logs").exists() and not (tmp_path / "new").exists()


def test_a_launch_checks_data_model_and_gpus_first_in_the_runs_own_words(tmp_path, tiny_model_dir):
    """What the run would refuse half a minute after its processes start is refused before anything starts."""
    from qlora_fsdp.studio.preflight import check_ranks
    from qlora_fsdp.studio.runs import Runs

    runs = Runs(tmp_path / "logs")
    out = f"train.output_dir={tmp_path / 'new'}"
    model = f"model.path={tiny_model_dir}"
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": \n')
    refused = {}
    for name, overrides in {"missing data": (model, "data.path=missing/records.jsonl"),
                            "broken record": (model, f"data.path={broken}"),
                            "unreachable model": ("model.path=nobody/no-such-model",)}.items():
        with pytest.raises(UserError) as caught:
            runs.launch(Draft("tiny_cpu", (out, *overrides)), 2)
        refused[name] = str(caught.value)
    assert refused == {
        "missing data": "data source missing/records.jsonl does not exist",
        "broken record": f"{broken}:2: not valid JSON (Expecting value)",
        "unreachable model": refused["unreachable model"]}
    assert refused["unreachable model"].startswith("model.path 'nobody/no-such-model' is neither a local folder nor "
                                                   "reachable on the hub")
    assert runs.current is None and not (tmp_path / "new").exists() and not (tmp_path / "logs").exists()
    gpu_recipe = load_config("llama3_8b_1x4090")
    with pytest.raises(UserError, match="^this machine has no GPU, and the recipe is for rtx4090: pick a tiny_cpu"):
        check_ranks(gpu_recipe, 1, gpus=0)
    with pytest.raises(UserError, match=r"^ranks: 2, but this machine has 1 GPU: one rank a GPU"):
        check_ranks(gpu_recipe, 2, gpus=1)
    check_ranks(gpu_recipe, 1, gpus=1)
    check_ranks(load_config("tiny_cpu"), 2, gpus=0)  # a CPU recipe: two gloo ranks on any machine


def test_an_error_line_shows_every_word_of_the_message():
    """A broken YAML's message names `<stream end>`: shown as text, not swallowed as an HTML tag."""
    from qlora_fsdp.studio.events import error_markdown

    shown = error_markdown("error: bad.yaml: expected ',' or ']', but got '<stream end>'")
    assert "&lt;stream end&gt;" in shown and "<stream end>" not in shown and error_markdown("") == ""


@pytest.mark.slow
def test_the_plan_worker_a_newer_request_ends_an_older_and_a_lever_applied_plans_what_it_promised():
    """A request made while a plan is under way ends that one (its caller gets None), and one followed within the
    settling time by a newer starts no process at all (a burst of edits plans once); a misfit's levers, each
    applied as the page applies it (the keys added to the draft), plan what they promised; a bad key is one line."""
    from qlora_fsdp.studio.plan_worker import PlanWorker

    worker = PlanWorker()
    misfit = Draft("tiny_cpu", ("hardware.gpu=rtx4090", "hardware.gpu_memory_gib=1.0", "data.context_length=2048",
                                "data.micro_batch_size=8", "data.grad_accum_steps=1",
                                "activation_checkpointing.mode=off"))
    results: list = []
    oldest = threading.Thread(target=lambda: results.append(worker.plan(Draft("tiny_cpu", ("lora.r=4",)))))
    oldest.start()
    time.sleep(0.2)  # the next edit of a burst
    older = threading.Thread(target=lambda: results.append(worker.plan(Draft("tiny_cpu"))))
    older.start()
    deadline = time.monotonic() + 120  # the warm server's first start imports the planner
    while worker.started == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)  # the older plan is under way (its child spawns a fake world: seconds)
    assert worker.started == 1  # the oldest request never started a plan
    data = worker.plan(misfit)
    older.join()
    oldest.join()
    assert results == [None, None] and worker.superseded == 1
    assert data is not None and not data["fits"], data
    total = sum(r["gib"] for r in data["gpu_rows"])
    assert total > 1.0 and f"| **total** | **{total:.2f}** | of 1 GiB |" in data["text"]
    assert data["time"] is not None and data["time"]["total"] == pytest.approx(
        sum(v for k, v in data["time"].items() if k != "total"))
    steps = load_config("tiny_cpu").train.max_steps  # the headline's hours: the step's price times the steps
    assert data["run_time"].endswith(f"for its {steps:,} steps ({data['time']['total']:.1f} s a step)")
    keys = [lever["overrides"] for lever in data["levers"]]
    assert {"data.micro_batch_size": 4, "data.grad_accum_steps": 2} in keys and {"data.context_length": 1024} in keys
    lever = next(lv for lv in data["levers"] if lv["overrides"] == {"data.context_length": 1024})
    assert lever["label"] in data["text"]
    after = worker.plan(misfit.with_overrides([f"{k}={json.dumps(v)}" for k, v in lever["overrides"].items()]))
    assert after is not None and after["fits"] and not after["levers"]
    # the server keeps the steps its plans measured: an edit that leaves the step alone measures nothing (its plan
    # takes a fraction of a second), and neither does the lever's plan (the misfit's plan measured its step)
    assert data["steps_measured"] > 0 and after["steps_measured"] == 0
    retimed = worker.plan(misfit.with_overrides(["train.max_steps=7"]))
    assert retimed is not None and retimed["steps_measured"] == 0 and retimed["gpu_rows"] == data["gpu_rows"]
    again = worker.plan(misfit.with_overrides([f"{k}={json.dumps(v)}" for k, v in lever["overrides"].items()]
                                              + ["train.max_steps=7"]))
    assert again is not None and again["steps_measured"] == 0 and again["gpu_rows"] == after["gpu_rows"]
    started = worker.started
    assert worker.plan(misfit) == data and worker.started == started  # asked again: answered without a process
    assert sum(r["gib"] for r in after["gpu_rows"]) == pytest.approx(lever["gpu_gib"], abs=1e-6)
    assert worker.plan(Draft("tiny_cpu", ("hardware.gpu=rtx4091",)))["error"].startswith(  # type: ignore[index]
        "error: unknown hardware.gpu 'rtx4091': choose one of")
    # a request needing the step a plan under way measures: that plan is not ended (its caller is answered None),
    # and the newer one waits for its step instead of measuring it again
    first = threading.Thread(target=lambda: results.append(worker.plan(Draft("tiny_cpu", ("lora.r=4",)))))
    started, superseded = worker.started, worker.superseded
    first.start()
    deadline = time.monotonic() + 120  # a settling second, then a fork: seconds even on a loaded machine
    while worker.started == started and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker.started > started, "the first plan did not start within 120 s"
    time.sleep(1)  # its step is being measured (seconds)
    second = worker.plan(Draft("tiny_cpu", ("lora.r=4", "train.max_steps=7")))
    first.join()
    assert results[-1] is None and worker.superseded == superseded
    assert second is not None and second["fits"] and second["steps_measured"] == 0
    worker.close()


def started(workers, adapter: str, recipe: str) -> tuple:
    """(the chat worker, "") or (None, why it did not start)."""
    try:
        return workers.worker(adapter, recipe), ""
    except UserError as err:
        return None, str(err)


@pytest.mark.slow
def test_chat_workers_stream_the_reply_qlora_generate_prints_and_two_answer_side_by_side(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    """The chat worker's streamed reply grows token by token into the reply `qlora-generate` prints for the same
    prompt; a second worker (another model: the tiny base in fp4) answers beside it, as Compare holds two, and
    the first still answers as before. The server's environment holds a distributed world's variables, its
    store's port taken (as a process that made a world of one leaves them): each worker still makes its own."""
    from qlora_fsdp.studio.chat import BASE_MODEL, ChatWorkers, Settings
    from qlora_fsdp.studio.environment import child_environment

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(taken.getsockname()[1]))):
        monkeypatch.setenv(key, value)

    text = (ROOT / "recipes" / "tiny_cpu.yaml").read_text().replace("models/tiny-llama", str(tiny_model_dir))
    recipe, fp4 = tmp_path / "recipe.yaml", tmp_path / "fp4.yaml"
    recipe.write_text(text)
    fp4.write_text(text + "quant:\n  quant_type: fp4\n")
    prompt, settings = "Reverse the letters of the word. river", Settings(max_new_tokens=12)
    workers = ChatWorkers()
    try:
        first, error = started(workers, BASE_MODEL, str(recipe))
        assert first is not None, f"the chat worker did not start: {error}"
        grown = list(first.stream(prompt, settings))
        cli = subprocess.run([sys.executable, "scripts/generate.py", "--recipe", str(recipe), "--no-adapter",
                              "--prompt", prompt, "--max-new-tokens", "12"], cwd=ROOT, capture_output=True, text=True,
                             env=child_environment())  # its own world of one, as the chat worker's
        assert cli.returncode == 0, cli.stderr[-2000:]
        assert grown[-1] == cli.stdout.rstrip("\n") and len(grown) > 2
        assert all(grown[-1].startswith(part.rstrip("\ufffd")) for part in grown[:-1])  # it grows, never rewrites
        second, error = started(workers, BASE_MODEL, str(fp4))
        assert second is not None, f"the second chat worker did not start: {error}"
        other = list(second.stream(prompt, settings))[-1]
        assert len(workers.workers) == 2 and other != grown[-1]  # another model, another reply
        assert list(workers.worker(BASE_MODEL, str(recipe)).stream(prompt, settings))[-1] == grown[-1]
        with pytest.raises(UserError, match="adapter folder not found: .*nowhere"):
            workers.worker(str(tmp_path / "nowhere"), str(recipe))
        assert len(workers.workers) == 1  # the failed one is not kept (nor the one it replaced)
    finally:
        workers.close()
        taken.close()


def test_the_run_view_reads_the_files_again_only_when_they_grew_and_says_how_the_run_ended(tmp_path):
    from qlora_fsdp.studio.runs import Run
    from qlora_fsdp.studio.session import Studio

    studio = Studio(tmp_path / "studio")
    assert studio.run_view().status == "no run launched or followed from this page yet"
    out, log = tmp_path / "run", tmp_path / "run.log"
    out.mkdir()
    write_lines(out / "metrics.jsonl", [{"time": 1.0, "event": "start", "config": {"train": {"max_steps": 4}}},
                                        {"time": 2.0, "step": 1, "loss": 2.0}])
    log.write_text("loading\nerror: data file data/x.jsonl not found; check data.path\n")
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])
    failed.wait()
    studio.runs.current = Run(Draft("tiny_cpu"), 2, out, log, failed, resumed=False)
    first = studio.run_view()
    assert first.changed and first.progress.step == 1 and first.series["loss"] == [(1, 2.0)]
    assert first.status == "failed (exit 2): error: data file data/x.jsonl not found; check data.path"
    assert not studio.run_view(first.seen).changed  # another page that saw it: nothing to draw again
    assert studio.run_view("").changed  # a page that has not seen it yet
    write_lines(out / "metrics.jsonl", [{"time": 1.0, "event": "start", "config": {"train": {"max_steps": 4}}},
                                        {"time": 2.0, "step": 1, "loss": 2.0}, {"time": 3.0, "step": 2, "loss": 1.0}])
    grown = studio.run_view(first.seen)
    assert grown.changed and grown.progress.words().startswith("step 2/4 · loss 1")
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    (out / "adapter").mkdir()
    (out / "adapter" / "adapter_config.json").write_text("{}")
    with (out / "metrics.jsonl").open("a") as f:  # what a run that ended well writes last
        f.write(json.dumps({"time": 4.0, "event": "summary", "steps": 2}) + "\n")
    studio.runs.current = Run(Draft("tiny_cpu"), 2, out, log, done, resumed=False)
    assert studio.run_view().status == f"finished: the adapter is in {out / 'adapter'}"
    assert studio.new_adapter() == str(out / "adapter") and studio.new_adapter() is None  # offered once a run
    # any run folder followed (a terminal's): its curves and progress in place of the page's own run
    other = tmp_path / "terminal-run"
    other.mkdir()
    write_lines(other / "metrics.jsonl", [{"time": 1.0, "event": "start", "config": {"train": {"max_steps": 9}}},
                                          {"time": 2.0, "step": 1, "loss": 5.0}])
    assert studio.follow(str(tmp_path)).startswith(f"error: {tmp_path} holds no metrics.jsonl: not a run folder")
    assert studio.follow(str(other)) == ""
    followed = studio.run_view(grown.seen)
    assert followed.changed and followed.series["loss"] == [(1, 5.0)] and followed.progress.words().startswith(
        "step 1/9")
    assert followed.status.startswith("ended without a checkpoint or a summary")
    assert studio.shown_run() is studio.followed


def test_the_run_log_shows_a_progress_bar_as_a_terminal_does(tmp_path):
    from qlora_fsdp.studio.runs import Run

    log = tmp_path / "run.log"
    log.write_text("$ torchrun ...\nloading\ntrain:  10%|#  | 1/10\rtrain:  20%|##  | 2/10\rtrain:  30%|### | 3/10")
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    run = Run(Draft("tiny_cpu"), 2, tmp_path, log, done, resumed=False)
    assert run.log_tail() == "$ torchrun ...\nloading\ntrain:  30%|### | 3/10"
    assert run.log_tail(lines=1) == "train:  30%|### | 3/10"


def test_stop_signals_each_rank_once(tmp_path):
    """Stop sends SIGTERM to torchrun's children (its ranks), not to torchrun; a second Stop is refused, since a
    rank's second signal ends it before its checkpoint is written."""
    from qlora_fsdp.studio.runs import Run, Runs

    rank = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: open(sys.argv[1], 'a').write('rank\\n'))\n"
            "open(sys.argv[1] + '.ready', 'w').close()\n"
            "time.sleep(60)\n")
    script = ("import os, signal, subprocess, sys, time\n"
              f"child = subprocess.Popen([sys.executable, '-c', {rank!r}, sys.argv[1]])\n"
              "while not os.path.exists(sys.argv[1] + '.ready'): time.sleep(0.05)\n"
              "signal.signal(signal.SIGTERM, lambda *a: open(sys.argv[1], 'a').write('torchrun\\n'))\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    marks = tmp_path / "signals"
    launcher = subprocess.Popen([sys.executable, "-c", script, str(marks)], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        assert launcher.stdout is not None and launcher.stdout.readline().strip() == "ready"
        runs = Runs(tmp_path / "logs")
        runs.current = Run(Draft("tiny_cpu"), 1, tmp_path, tmp_path / "log", launcher, resumed=False)
        runs.stop()
        deadline = time.monotonic() + 10
        while not marks.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)  # a signal to the launcher too would have been written by now
        assert marks.read_text() == "rank\n"  # the rank got it, the launcher did not
        with pytest.raises(UserError, match="stopping already"):
            runs.stop()
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_the_page_starts_when_its_port_answers_late_and_its_events_never_drop_an_edit(tmp_path, monkeypatch):
    """Gradio's few-second check that the port answers (a loaded machine fails it) does not end the page; the
    command checks with more patience, and the page answers. Every event that leads to a plan runs for each edit
    (Gradio's default skips a trigger while the same event runs: an edit made during a plan was never planned),
    and a page opened later lists the adapters written since the server started."""
    import socket

    import gradio.networking

    from qlora_fsdp.studio.app import answers, serve
    from qlora_fsdp.studio.session import Studio

    monkeypatch.setattr(gradio.networking, "url_ok", lambda url: False)  # the port too slow to answer in time
    monkeypatch.chdir(tmp_path)  # the page looks for adapters under ./outputs
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    studio = Studio(tmp_path / "state")
    refused = ""
    try:
        page = serve(studio, "127.0.0.1", port)
    except ValueError as err:
        refused = str(err)
    assert refused == ""
    try:
        assert answers(f"http://127.0.0.1:{port}", seconds=60)
        events = list(page.fns.values())
        edits = [e for e in events if e.fn.__name__ == "<lambda>" and "blur" in {t[1] for t in e.targets}]
        planning = [*edits, *(e for e in events if e.fn.__name__ in ("load", "refresh", "replan"))]
        assert len(planning) > 20 and {e.trigger_mode for e in planning} == {"multiple"}
        adapter = tmp_path / "outputs" / "later" / "adapter"
        adapter.mkdir(parents=True)
        (adapter / "adapter_config.json").write_text("{}")  # written after the page was built
        opened = [e.fn for e in events if [t[1] for t in e.targets] == ["load"] and e.fn.__name__ == "find"]
        assert len(opened) == 1 and opened[0]()[0]["value"] == str(Path("outputs/later/adapter"))
    finally:
        page.close()
        studio.close()


def test_the_form_keeps_its_edits_and_the_plan_is_of_the_ranks_that_launch(tmp_path):
    """Clearing a mistyped path (the same recipe again) or an emptied picker keeps the form's edits; a new recipe
    loads its own. The ranks box is folded into the draft, so the plan's world, the command and the launch agree
    (the tiny CPU recipes say one GPU and train on two ranks); a `hardware.gpus_per_node` set by hand wins."""
    from qlora_fsdp.studio.session import Studio

    studio = Studio(tmp_path)
    assert studio.shown_recipe("tiny_cpu", "", "tiny_cpu") == (None, "", "tiny_cpu")  # the path cleared
    cfg, error, shown = studio.shown_recipe("", "", "tiny_cpu")
    assert (cfg, shown) == (None, "tiny_cpu") and error.startswith("error: pick a recipe")
    cfg, error, shown = studio.shown_recipe("tiny_cpu", "nothere.yaml", "tiny_cpu")
    assert (cfg, shown, error) == (None, "tiny_cpu", "error: recipe file not found: nothere.yaml")
    cfg, error, shown = studio.shown_recipe("tiny_cpu_dpo", "", "tiny_cpu")
    assert cfg is not None and cfg.train.objective == "dpo" and (error, shown) == ("", "tiny_cpu_dpo")
    values = studio.form_for(load_config("tiny_cpu"))
    resolved = studio.resolved("tiny_cpu", values, "", ranks=2)
    assert resolved.config is not None and resolved.config.hardware.world_size == 2
    assert studio.command(resolved) == ("torchrun --nproc_per_node 2 train.py --recipe tiny_cpu "
                                        "hardware.gpus_per_node=2")
    assert studio.resolved("tiny_cpu", values, "", ranks=1).draft.overrides == ()  # the recipe's own world
    by_hand = studio.resolved("tiny_cpu", values, "hardware.gpus_per_node=3", ranks=2)
    assert by_hand.config is not None and by_hand.config.hardware.gpus_per_node == 3
    assert studio.command(by_hand).startswith("torchrun --nproc_per_node 3 ")
    gpu = studio.resolved("llama70b_2x4090", studio.form_for(load_config("llama70b_2x4090")), "", ranks=2)
    assert gpu.draft.overrides == () and studio.command(gpu).startswith("torchrun --nproc_per_node 2 ")
    studio.close()


def test_the_recipe_picker_says_each_recipes_hardware_and_its_last_plans_verdict_and_hours(tmp_path):
    from qlora_fsdp.studio.events import plan_outputs
    from qlora_fsdp.studio.session import Studio

    studio = Studio(tmp_path)
    labels = dict((value, label) for label, value in studio.picker_choices())
    assert set(labels) == {p.stem for p in RECIPES_DIR.glob("*.yaml")}
    assert labels["tiny_cpu"] == "tiny_cpu · CPU"
    assert labels["qwen3_8b_1x24gb_grpo"] == "qwen3_8b_1x24gb_grpo · 1x rtx4090 · FITS"  # the header's verdict
    card = studio.recipe_card("qwen3_8b_1x24gb_grpo", "")
    assert "Qwen3 8B learns grade-school math" in card and "`Qwen/Qwen3-8B`" in card
    assert "FITS: 17.68 GiB a GPU of 24" in card
    planned = {"fits": False, "run_time": "3.2 h for its 100 steps (115.0 s a step)", "description": "d",
               "levers": [], "text": "", "time": None, "generating_rows": [], "host_rows": [],
               "gpu_rows": [{"name": "weights", "gib": 20.0, "basis": ""}], "capacity_gib": 24.0,
               "host_capacity_gib": 64.0}
    studio.plan_records.record("llama70b_2x4090", ("lora.r=8",), planned)
    assert dict((v, lb) for lb, v in Studio(tmp_path).picker_choices())["llama70b_2x4090"] == (
        "llama70b_2x4090 · 2x rtx4090 · DOES NOT FIT 3.2 h for its 100 steps (115.0 s a step)")  # kept on disk
    assert "last plan: DOES NOT FIT, 3.2 h for its 100 steps" in studio.recipe_card("llama70b_2x4090", "")
    assert "with lora.r=8" in studio.recipe_card("llama70b_2x4090", "")
    assert plan_outputs(planned)[0].startswith("**DOES NOT FIT**; the run: **3.2 h for its 100 steps")
    assert studio.recipe_card("tiny_cpu", "my.yaml") == ""  # a file of one's own has no card
    studio.close()
