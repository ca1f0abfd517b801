"""tests/gpu_check.py, the command for the day a GPU is lent, works on the CPU: help, a dry run, isolation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests import gpu_check
from tests.helpers import REPO, command_here

# one thread: under `make test` the other lane keeps the second core busy, and a second OpenMP thread spins on it
# (the dry run took 139 s of CPU there, 71 s alone)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def table_rows(text: str) -> dict[str, tuple[str, str]]:
    """check -> (result, status) from the markdown table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] not in ("check", "---"):
            rows[cells[0]] = (cells[1], cells[3])
    return rows


def test_help_lists_every_check():
    done = command_here(gpu_check.main, ["--help"])
    assert done.returncode == 0
    for check in gpu_check.CHECKS:
        assert check.name in done.stdout


def test_unknown_check_is_a_one_line_error():
    done = command_here(gpu_check.main, ["--only", "nan_canry"])
    assert done.returncode == 2 and "unknown check nan_canry" in done.stderr


@pytest.mark.slow
def test_dry_run_passes_and_skips_what_needs_cuda(tmp_path):
    """Every check, as `make gpu-check` runs them: those a CPU can run pass, the CUDA-only ones are skipped. In the
    test sequence, not beside it (tests/background.py): each check has a time limit, which a process at low
    priority on a busy machine can overrun (one run here timed out three checks that way)."""
    out = tmp_path / "gpu_check.md"
    done = subprocess.run([sys.executable, "-m", "tests.gpu_check", "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, env=ENV, timeout=420, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = table_rows(out.read_text())
    assert {name: status for name, (_, status) in rows.items()} == {
        "nan_canary": "passed", "fsdp_real_path": "passed", "fsdp_real_path (old bf16 storage)": "info",
        "merge_device (cpu)": "passed", "merge_device (cuda vs cpu)": "skipped", "generate": "passed",
        "memory_levers": "passed", "packed_attention (sdpa)": "passed", "packed_attention (sdpa_varlen)": "passed",
        "packed_attention (speed)": "info", "plan_vs_measured_70b": "skipped", "one_gpu_70b_offload": "skipped",
        "moe_experts (unquantized)": "info", "moe_experts (4-bit, gather per expert)": "info",
        "moe_experts (4-bit, grouped (ours))": "info", "moe_experts (4-bit, grouped matmul)": "info",
        "long_rows (llama3_8b_1x4090_long)": "passed", "long_rows (gpt_oss_20b_1x24gb_long)": "passed",
        "grpo_generation (8 rows, gathered:on:auto)": "info",
        "grpo_generation (8 rows, gathered:off:auto)": "info", "training_speed": "passed", "export_rounding": "passed"}
    for check in gpu_check.CHECKS:  # a check added later is in this run too, and runs unless it needs CUDA
        assert check.cuda_only == ("needs a CUDA device" in rows.get(check.name, ("", ""))[0]), check.name
    figures = {c["check"]: c["figures"] for c in json.loads(out.with_suffix(".json").read_text())["checks"]}
    assert figures["nan_canary"]["uint8_bytes_changed"] == 0
    assert figures["nan_canary"]["emulated_cuda_bf16_changed"] == 253  # every NaN pattern but 0x7FFF itself
    assert figures["fsdp_real_path"]["uint8_offload_on_bytes_differing"] == 0
    settings = figures["memory_levers"]["settings"]  # each lever trained; none changed the loss
    assert len(settings) == 8 and len({round(s["loss"], 5) for s in settings[:6]}) == 1  # memory levers
    # fp32 LoRA matmuls and PEFT's forward: other roundings of the same loss
    assert all(abs(s["loss"] / settings[1]["loss"] - 1) < 1e-2 for s in settings[6:])
    assert figures["fsdp_real_path"]["uint8_offload_on_gathers"] > 0
    assert figures["packed_attention (sdpa_varlen)"]["max_difference"] <= 1e-4
    assert figures["merge_device (cpu)"]["tensors"] > 0 and figures["generate"]["characters"] > 0
    for recipe in ("llama3_8b_1x4090_long", "gpt_oss_20b_1x24gb_long"):
        assert [row["tokens"] for row in figures[f"long_rows ({recipe})"]["rows"] if row["trained"]] == [256, 512]
    assert figures["moe_experts (4-bit, grouped (ours))"]["tokens_per_s"] > 0
    assert all(figures["export_rounding"][kind]["equal"] and figures["export_rounding"][kind]["kernel_equal"]
               for kind in ("q8_0", "q4_0", "q4_K", "q6_K"))  # the kernel interpreted here
    assert all(figures[f"grpo_generation (8 rows, gathered:{graphs}:auto)"]["ratio"] > 0 for graphs in ("on", "off"))
    speed = figures["training_speed"]  # both trainers ran the same steps; the plan priced ours
    assert speed["ours_tokens_per_s"] > 0 and speed["trainer_tokens_per_s"] > 0 and speed["plan_tokens_per_s"] > 0
    assert abs(speed["ours_eval_loss"] / speed["trainer_eval_loss"] - 1) < 0.05
    # the positive control: the watch does see CUDA's rewrite of the old bf16 storage
    assert figures["fsdp_real_path (old bf16 storage)"]["emulated_cuda_copy_elements_changed"] > 0


FAKE_CASES = """
import json, sys, time
name, result = sys.argv[1], sys.argv[sys.argv.index("--result") + 1]
if name == "nan_canary":
    sys.exit(3)  # a crash: no result written
if name == "fsdp_real_path":
    time.sleep(60)  # past its budget
json.dump({"rows": [{"check": name, "status": "passed", "result": "ok", "figures": {"x": 1}}]}, open(result, "w"))
"""


def fake_case(name: str):
    """The forked checks' stand-ins for FAKE_CASES: a crash (no result), one past its budget, one that passes."""
    def case(ctx) -> list:
        if name == "nan_canary":
            os._exit(3)  # a crash: no result written
        if name == "fsdp_real_path":
            time.sleep(60)  # past its budget
        return [gpu_check.Row(name, "passed", "ok", {"x": 1})]
    return case


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["process", "fork"])
def test_a_crash_or_a_timeout_fails_that_check_only(tmp_path, monkeypatch, runner):
    """Either way a check runs (a fresh process on a GPU, a fork of the warm parent on the CPU)."""
    if runner == "process":
        cases = tmp_path / "cases.py"
        cases.write_text(FAKE_CASES)
        monkeypatch.setattr(gpu_check, "CASES_COMMAND", [sys.executable, str(cases)])
    else:
        from tests import gpu_check_cases

        names = ("nan_canary", "fsdp_real_path", "merge_device", "one_gpu_70b_offload")
        monkeypatch.setattr(gpu_check_cases, "CASES", {name: fake_case(name) for name in names})
    monkeypatch.setattr(gpu_check, "CHECKS", (
        gpu_check.Check("nan_canary", 30, cuda_only=False), gpu_check.Check("fsdp_real_path", 2, cuda_only=False),
        gpu_check.Check("merge_device", 30, cuda_only=False), gpu_check.Check("one_gpu_70b_offload", 30, True)))
    names = [c.name for c in gpu_check.CHECKS]
    rows, _ = gpu_check.run_all(names, "cpu", tmp_path, total_s=120)
    by_name = {r.check: r for r in rows}
    assert by_name["nan_canary"].status == "failed" and "exit code 3" in by_name["nan_canary"].result
    assert by_name["fsdp_real_path"].status == "failed" and "timed out" in by_name["fsdp_real_path"].result
    assert by_name["merge_device"].status == "passed"
    assert by_name["one_gpu_70b_offload"].status == "skipped"


@pytest.mark.parametrize(("name", "json_name"), [("table.md", "table.json"), ("table.json", "table.json.json")])
def test_out_writes_the_table_and_its_figures(tmp_path, name, json_name):
    rows = [gpu_check.Row("nan_canary", "passed", "a | b", {"n": 1234, "r": 0.5})]
    gpu_check.write_outputs(tmp_path / name, gpu_check.format_table(rows), rows, "cpu", {}, 1.0)
    assert "| nan_canary | a \\| b | n 1,234, r 0.5 | passed |" in (tmp_path / name).read_text()
    figures = json.loads((tmp_path / json_name).read_text())
    assert figures["checks"][0]["figures"] == {"n": 1234, "r": 0.5}
