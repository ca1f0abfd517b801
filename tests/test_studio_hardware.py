"""The studio's hardware view (GPUs through a fake NVML, host RAM, the chosen GPUs, each step's peaks) and the runs
it finds under outputs/, whoever started them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from qlora_fsdp.config import load_config
from qlora_fsdp.errors import UserError
from qlora_fsdp.readouts.machine_gpus import FAKE_NVML_ENV, HardwareMonitor, cuda_visible_devices, hardware_markdown
from qlora_fsdp.studio.draft import Draft


def write_gpus(path: Path, *used: tuple[float, float]) -> None:
    """Fake GPUs (used GiB, utilisation %) of 24 GiB each, written whole as a test the studio runs would."""
    gpus = [{"name": "NVIDIA GeForce RTX 4090", "total_gib": 24.0, "used_gib": u, "utilisation": b} for u, b in used]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    os.replace(tmp, path)


@dataclass
class FakeRun:
    output_dir: Path
    running: bool = True


def wait_for_samples(monitor: HardwareMonitor, more: int) -> None:
    target, deadline = monitor.samples + more, time.monotonic() + 10
    while monitor.samples < target:
        assert time.monotonic() < deadline, "the sampler stopped sampling"
        time.sleep(0.01)


def metrics(path: Path, *records: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


START = {"time": 1.0, "event": "start", "config": {"train": {"max_steps": 4, "objective": "sft"},
                                                   "model": {"path": "models/tiny-llama"}}}


def test_fake_gpus_fill_the_table_and_a_peak_between_two_looks_is_kept_as_its_steps_peak(tmp_path, monkeypatch):
    from qlora_fsdp.studio.hardware_tab import peaks_figure

    fake = tmp_path / "gpus.json"
    write_gpus(fake, (1.0, 5.0), (0.5, 0.0))
    monkeypatch.setenv(FAKE_NVML_ENV, str(fake))
    monitor = HardwareMonitor(interval_s=0.01)
    now, peaks = monitor.take()
    table = hardware_markdown(now, monitor.error)
    assert "| 0 | NVIDIA GeForce RTX 4090 | 1.0 / 24.0 GiB | 5% |" in table.splitlines()
    assert "| 1 | NVIDIA GeForce RTX 4090 | 0.5 / 24.0 GiB | 0% |" in table.splitlines()
    assert table.splitlines()[-1].startswith("| host | RAM | ") and peaks == {}
    run = FakeRun(tmp_path / "run")
    metrics(run.output_dir / "metrics.jsonl", START, {"time": 2.0, "step": 1, "loss": 2.0})  # step 2 trains
    monitor.follow(run)
    try:
        wait_for_samples(monitor, 2)
        monitor.take()  # the page's look before the peak
        write_gpus(fake, (20.0, 100.0), (0.5, 0.0))  # a brief peak, over before the page's next look
        wait_for_samples(monitor, 2)
        write_gpus(fake, (1.0, 5.0), (0.5, 0.0))
        wait_for_samples(monitor, 2)
        seen, peaks = monitor.take()
        assert (seen.gpus[0].used_gib, seen.gpus[0].utilisation) == (20.0, 100.0)  # kept for the next look
        assert peaks[2].gpus[0].used_gib == 20.0 and peaks[2].gpus[1].used_gib == 0.5
        assert monitor.take()[0].gpus[0].used_gib == 1.0  # taken: the next look starts afresh
        metrics(run.output_dir / "metrics.jsonl", {"time": 3.0, "step": 2, "loss": 1.0})  # step 3 trains now
        wait_for_samples(monitor, 2)
        run.running = False  # the run ended: the sampler stops with it
        assert monitor.thread is not None
        monitor.thread.join(timeout=5)
        assert not monitor.thread.is_alive()
    finally:
        monitor.close()
    _, peaks = monitor.take()
    assert peaks[2].gpus[0].used_gib == 20.0 and peaks[3].gpus[0].used_gib == 1.0
    figure = peaks_figure(peaks)
    assert figure is not None
    assert [line.get_label() for line in figure.axes[0].lines] == ["GPU 0", "GPU 1", "host RAM"]
    assert max(figure.axes[0].lines[0].get_ydata()) == 20.0


def test_without_nvml_the_view_says_why_in_one_line_and_offers_the_cpu_recipes(tmp_path, monkeypatch):
    import gradio as gr

    from qlora_fsdp.studio.hardware_tab import hardware_tab, hardware_tick, tick_outputs
    from qlora_fsdp.studio.session import Studio

    fake = tmp_path / "gpus.json"
    fake.write_text(json.dumps({"error": "Driver Not Loaded"}))
    monkeypatch.setenv(FAKE_NVML_ENV, str(fake))
    monitor = HardwareMonitor()
    first = hardware_markdown(monitor.take()[0], monitor.error).splitlines()[0]
    assert first.startswith("no GPU found (NVML: Driver Not Loaded): the CPU recipes train here (tiny_cpu, ")
    assert monitor.visible([]) is None  # a launch keeps today's environment
    with gr.Blocks():
        hw = hardware_tab(monitor)
        part = hardware_tick(Studio(tmp_path / "studio"), hw)
    assert part.outputs[:2] == [hw.table, hw.peaks]
    assert hw.gpus.choices == [] and not hw.gpus.visible and hw.table.value.startswith("no GPU found")
    table, curve, drawn = tick_outputs(monitor, None, -1)  # no run: the table alone, no peaks to draw
    assert table.startswith("no GPU found") and curve is None and drawn == 0
    assert all(c.elem_id.startswith("hw-") for c in (hw.table, hw.gpus, hw.peaks, hw.note))


def test_the_chosen_gpus_reach_the_childs_environment_and_the_preflight_counts_them(tmp_path, monkeypatch):
    from qlora_fsdp.studio import runs as runs_module
    from qlora_fsdp.studio.preflight import check_ranks

    assert cuda_visible_devices([2, 0, 2]) == {"CUDA_VISIBLE_DEVICES": "0,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    gpu_recipe = load_config("llama3_8b_1x4090")
    with pytest.raises(UserError, match=r"^ranks: 2, but 1 GPU chosen: one rank a GPU"):
        check_ranks(gpu_recipe, 2, gpus=1, chosen=True)
    with pytest.raises(UserError, match="^no GPU is chosen, and the recipe is for rtx4090: tick the GPUs to use"):
        check_ranks(gpu_recipe, 1, gpus=0, chosen=True)
    with pytest.raises(UserError, match=r"^ranks: 2, but 1 GPU chosen"):  # counted before anything starts
        runs_module.Runs(tmp_path / "logs").launch(Draft("llama3_8b_1x4090"), 2, visible_gpus=[3])

    counted, started = [], []
    monkeypatch.setattr(runs_module, "check_before_launch", lambda cfg, ranks, gpus=None, chosen=False:
                        counted.append((ranks, gpus, chosen)))
    real_popen = subprocess.Popen

    def popen(command, **kwargs):  # the child's environment, then a child that ends at once
        started.append(kwargs["env"])
        return real_popen([sys.executable, "-c", "pass"])

    monkeypatch.setattr(runs_module.subprocess, "Popen", popen)
    runs = runs_module.Runs(tmp_path / "logs")
    out = f"train.output_dir={tmp_path / 'out'}"
    run = runs.launch(Draft("tiny_cpu", (out,)), 2, visible_gpus=[1, 0])
    run.process.wait()
    assert counted == [(2, 2, True)] and run.visible_gpus == [1, 0]
    assert started[0]["CUDA_VISIBLE_DEVICES"] == "0,1" and started[0]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert run.log_path.read_text().startswith("$ CUDA_VISIBLE_DEVICES=0,1 CUDA_DEVICE_ORDER=PCI_BUS_ID torchrun ")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    runs.launch(Draft("tiny_cpu", (f"train.output_dir={tmp_path / 'other'}",)), 2).process.wait()
    assert counted[-1] == (2, None, False) and started[-1]["CUDA_VISIBLE_DEVICES"] == "5"  # None: as before


def run_folders_by_hand(root: Path) -> dict[str, Path]:
    """Folders as train.py leaves them: finished, stopped by a signal, one a live process writes to, and one that
    ended before its first checkpoint; the studio's logs beside them are no run."""
    folders = {name: root / where for name, where in
               {"finished": "a/finished", "stopped": "stopped", "running": "b/c/running", "failed": "failed"}.items()}
    steps = [{"time": 2.0 + s, "step": s, "loss": 2.0 / s} for s in (1, 2)]
    metrics(folders["finished"] / "metrics.jsonl", START, *steps, {"time": 9.0, "event": "summary", "steps": 2})
    (folders["finished"] / "adapter").mkdir()
    (folders["finished"] / "adapter" / "adapter_config.json").write_text("{}")
    metrics(folders["stopped"] / "metrics.jsonl", START, *steps,
            {"time": 9.0, "event": "summary", "stopped_by_signal": True})
    for name in ("finished", "stopped"):
        checkpoint = folders[name] / "checkpoints" / "step-000002"
        checkpoint.mkdir(parents=True)
        (checkpoint / "trainer_state.json").write_text('{"step": 2}')
    metrics(folders["running"] / "metrics.jsonl", START, steps[0])
    metrics(folders["failed"] / "metrics.jsonl", START)
    metrics(root / "studio" / "logs" / "x" / "metrics.jsonl", START)
    for age, name in enumerate(("running", "failed", "stopped", "finished")):  # newest first, as listed
        os.utime(folders[name] / "metrics.jsonl", (time.time() - age * 60,) * 2)
    return folders


def test_runs_under_finds_every_run_folder_with_its_state_whoever_started_it(tmp_path):
    """A run's state is outputs/run_card.py's one definition: running while the process its run.json names lives
    (a terminal's training, here a sleeping process), then what its files say; a later process given the same pid
    is not the run."""
    from dataclasses import replace

    from qlora_fsdp.outputs.run_card import RunCard, read_run_card, write_run_card
    from qlora_fsdp.studio.run_folders import FollowedRun, runs_under

    root = tmp_path / "outputs"
    folders = run_folders_by_hand(root)
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=tmp_path)
    try:
        card = replace(RunCard.of_this_process("tiny_cpu", ["train.max_steps=4"], folders["running"], 2, {}),
                       pid=process.pid)
        card = replace(card, started_ticks=process_ticks(process.pid))
        write_run_card(folders["running"], card)
        assert read_run_card(folders["running"]) == card and FollowedRun(folders["running"]).running
        found = runs_under(root)
        write_run_card(folders["running"], replace(card, started_ticks=card.started_ticks - 1))  # a reused pid
        assert runs_under(root)[0].state == "failed"
    finally:
        process.kill()
        process.wait()
    assert [(f.path, f.state) for f in found] == [(folders[name], name) for name in
                                                  ("running", "failed", "stopped", "finished")]
    assert (found[0].step, found[0].max_steps, found[0].objective, found[0].model) == (1, 4, "sft",
                                                                                     "models/tiny-llama")
    assert found[0].words().endswith("running · sft on models/tiny-llama · step 1/4")
    write_run_card(folders["running"], card)
    assert runs_under(root)[0].state == "failed"  # its process ended: no summary, no checkpoint


def process_ticks(pid: int) -> int:
    from qlora_fsdp.outputs.run_card import process_start_time

    ticks = process_start_time(pid)
    assert ticks is not None
    return ticks


def test_a_followed_run_reads_as_the_pages_own_run(tmp_path):
    from qlora_fsdp.studio.run_folders import NO_LOG, FollowedRun
    from qlora_fsdp.studio.session import Studio

    folders = run_folders_by_hand(tmp_path / "outputs")
    finished = FollowedRun(folders["finished"])
    assert not finished.running and finished.status() == f"finished: the adapter is in {folders['finished']}/adapter"
    assert finished.log_tail() == NO_LOG
    assert FollowedRun(folders["stopped"]).status().startswith(f"stopped; the checkpoint in {folders['stopped']} ")
    logs = tmp_path / "outputs" / "studio" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "failed-20261129-070000.log").write_text("$ torchrun ...\ntrain:  10%|#| 1/4\rtrain:  20%|#| 2/4\n"
                                                     "error: data file data/x.jsonl not found; check data.path\n")
    failed = FollowedRun(folders["failed"], logs)
    assert failed.log_tail().splitlines()[1] == "train:  20%|#| 2/4"  # as a terminal shows it
    assert failed.status() == "ended without a checkpoint or a summary: error: data file data/x.jsonl not found; " \
                              "check data.path"
    studio = Studio(tmp_path / "studio")
    studio.runs.current = FollowedRun(folders["stopped"])  # type: ignore[assignment]  # what run_view reads of it
    view = studio.run_view()
    assert view.progress.step == 2 and view.series["loss"] == [(1, 2.0), (2, 1.0)] and view.log == NO_LOG


def test_one_tick_refreshes_both_tabs_and_paces_itself_by_whether_the_shown_run_trains():
    import gradio as gr

    from qlora_fsdp.studio.ticks import IDLE_TICK_S, TICK_S, TickPart, fast, tick_function

    run_part = TickPart(lambda seen: ("running", seen + "!"), ["seen"], ["status", "seen"])
    hardware_part = TickPart(lambda drawn: ("table", drawn + 1), ["drawn"], ["table", "drawn"])
    live = [True]
    tick = tick_function([run_part, hardware_part], lambda: live[0])
    # each part gets its own inputs and fills its own outputs; then the timer's interval and the page's record of it
    assert tick("a", 1, IDLE_TICK_S) == ("running", "a!", "table", 2, TICK_S, TICK_S)  # a run trains: faster
    assert tick("a", 1, TICK_S)[-2:] == (gr.skip(), TICK_S)  # already fast: the timer is left alone
    live[0] = False
    assert tick("a", 1, TICK_S)[-2:] == (IDLE_TICK_S, IDLE_TICK_S)  # finished: slower
    assert tick("a", 1, IDLE_TICK_S)[-2:] == (gr.skip(), IDLE_TICK_S)
    assert fast() == (TICK_S, TICK_S) and TICK_S < IDLE_TICK_S
