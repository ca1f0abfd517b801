"""The step-time model's inputs and arithmetic: the work the planner's fake step counts is the model's (FLOPs of
every matmul, 4-bit weights dequantized, bytes gathered and copied), and the overlap of transfers with compute.
How well the priced step matches published runs is `python -m benchmarks.published_runs`
(docs/benchmarks/step-time.md)."""

from __future__ import annotations

import json

import pytest

from qlora_fsdp.measure.op_work import Work
from qlora_fsdp.plan.step_time import (
    GPU_MATMUL_EFFICIENCY,
    MATMUL_EFFICIENCY,
    PIPELINED_PARTS,
    Rates,
    link_seconds,
    part_time,
)
from qlora_fsdp.run.accelerators import GPU
from tests import planners
from tests.helpers import run_ranks
from tests.test_step_memory import architecture, step_config

# 24 published runs planned and priced (about 2 minutes of a core): beside the tests before it, in the planners'
# process (tests/planners.py, tests/background.py)
planners.register()
# the runs the model misses by more than 25%, and why: a step this small (7B, one row a GPU, on 3090s) took 2.1 s
# at 512 tokens and 3.1 s at 2,048 in Answer.AI's loop; the rig's PCIe 3.0 x4 gathers explain 1.3 s of it, and
# about 0.8 s a step that does not scale with the work is not modelled (the source's prose gives 550 s and 800 s
# for these two runs, its table 1,082 s and 1,564 s)
KNOWN_MISSES = {"answerai 2x3090 llama-2-7b 512 bs1", "answerai 2x3090 llama-2-7b 2048 bs1"}

LAYERS, HIDDEN, KV, INTERMEDIATE, RANK, TOKENS = 2, 256, 128, 672, 16, 256


def counted_work(info, configs):
    from qlora_fsdp.measure.fake_world import recipe_step
    from qlora_fsdp.measure.planning import Planning

    return [{f"{micro} {part}": vars(work) for (micro, part), work in recipe_step(Planning.of(cfg)).work.items()}
            for cfg in configs]


@pytest.mark.slow
def test_the_fake_step_counts_the_models_work(tmp_path):
    """Two layers (hidden 256, GQA, MLP 672), LoRA r=16 on every linear, one packed row of 256 tokens, 2 ranks,
    every layer checkpointed: the forward's matmul FLOPs are 2 x tokens x (base + LoRA weights), each 4-bit
    weight is dequantized once in forward and twice in backward (recompute, input gradients), backward's FLOPs
    are the recompute plus the input gradients of every matmul plus the LoRA weights' gradients; with offload
    every gathered shard is first copied to the GPU and every reduced gradient shard back."""
    model = architecture(tmp_path / "model", layers=LAYERS, hidden=HIDDEN, heads=4, kv_heads=2, vocab=8192)
    plain = step_config(model, TOKENS, 1, "hardware.gpu=rtx4090")
    offload = step_config(model, TOKENS, 1, "hardware.gpu=rtx4090", "fsdp_preset=full_shard_cpu_offload")
    counted, offloaded = run_ranks(counted_work, 2, [plain, offload], tmp_dir=tmp_path, fake=True)[0]

    shapes = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN), (HIDDEN, INTERMEDIATE),
              (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
    base = LAYERS * sum(i * o for i, o in shapes)
    lora = LAYERS * sum(RANK * (i + o) for i, o in shapes)
    # the first layer's q, k and v read the embeddings' output, which needs no gradient: autograd skips their
    # input gradients (and those of their LoRA A matrices)
    first_qkv, first_qkv_lora_a = sum(i * o for i, o in shapes[:3]), 3 * RANK * HIDDEN
    forward, backward = counted["0 forward"], counted["0 backward"]
    assert forward["matmul_flops"] == 2 * TOKENS * (base + lora)
    assert forward["dequant_elements"] == base and backward["dequant_elements"] == 2 * base - first_qkv
    # the base: recompute + input gradients, exactly; LoRA: recompute, then the weight and the input gradients of
    # A and B (3 x the forward's), less the input gradients autograd prunes: the count is within 2% of that hand
    # count (it finds two more A input gradients skipped, 8,192 x 2T of 427,008 x 2T, not identified yet)
    lora_backward = backward["matmul_flops"] - 2 * TOKENS * (2 * base - first_qkv)
    hand_count = 2 * TOKENS * (3 * lora - first_qkv_lora_a)
    assert 0.98 * hand_count <= lora_backward <= hand_count
    assert forward["layers"] == backward["layers"] == LAYERS
    assert forward["attention_flops"] > 0 and backward["attention_flops"] > forward["attention_flops"]
    assert forward["gather_bytes"] > 0 and counted["0 backward"]["scatter_bytes"] > 0
    assert forward["to_gpu_bytes"] == 0 and counted["0 backward"]["to_host_bytes"] == 0
    # 2 ranks: each receives the other's half, and (offloaded) first copies its own half to the GPU
    for part in PIPELINED_PARTS:
        assert offloaded[f"0 {part}"]["to_gpu_bytes"] == offloaded[f"0 {part}"]["gather_bytes"] > 0
    assert offloaded["0 backward"]["to_host_bytes"] == offloaded["0 backward"]["scatter_bytes"] > 0
    assert offloaded["1 optimizer"]["optimizer_bytes"] > 0


@pytest.fixture(scope="module")
def published_runs() -> dict:
    return json.loads(planners.part("published_runs"))


@pytest.mark.slow
def test_published_runs_are_predicted_within_a_quarter(published_runs):
    """Every published run (benchmarks/data/published_runs.json) predicted within 25%, but the known misses,
    which still miss (so the list shrinks when the model learns them). The efficiencies in step_time.py are the
    ones fitted on the `fit` half; the judged half was not used to choose them."""
    rows = published_runs["rows"]
    assert len(rows) == 24 and 2 * sum(r["fit"] for r in rows) <= len(rows)
    fitted = published_runs["fitted_efficiency"]
    assert {gpu: fitted[gpu] for gpu in GPU_MATMUL_EFFICIENCY} == GPU_MATMUL_EFFICIENCY
    assert fitted["all"] == MATMUL_EFFICIENCY
    missed = {r["id"] for r in rows if not 0.75 <= r["ratio"] <= 1.25}
    assert missed == KNOWN_MISSES, {r["id"]: round(r["ratio"], 2) for r in rows if r["id"] in missed}
    judged = [r for r in rows if not r["fit"] and r["id"] not in KNOWN_MISSES]
    assert len(judged) >= 10


def test_a_recipe_names_its_pcie_slots():
    """hardware.pcie_gen and hardware.pcie_lanes override the card's link (a desktop's second slot at x4 carries
    FSDP's gathers at an eighth of x16 gen 4); a slot that does not exist is refused with the valid ones."""
    from qlora_fsdp.config.loader import load_config
    from qlora_fsdp.errors import ConfigError
    from qlora_fsdp.plan.memory import gpu_spec

    usual = gpu_spec(load_config("llama70b_2x4090"))
    slow = gpu_spec(load_config("llama70b_2x4090", ["hardware.pcie_gen=3", "hardware.pcie_lanes=4"]))
    assert (usual.pcie_gen, usual.pcie_lanes, slow.pcie_gen, slow.pcie_lanes) == (4, 16, 3, 4)
    assert usual.pcie_gbps == pytest.approx(31.5, abs=0.01) and slow.pcie_gbps == pytest.approx(3.94, abs=0.01)
    gathers = Work(gather_bytes=1e9)
    assert link_seconds(gathers, Rates.of(slow))[0] == pytest.approx(8 * link_seconds(gathers, Rates.of(usual))[0])
    with pytest.raises(ConfigError, match="'hardware.pcie_lanes' must be one of 1, 2, 4, 8, 16 or null, got 6"):
        load_config("llama70b_2x4090", ["hardware.pcie_lanes=6"])


def test_transfers_hide_behind_compute_but_for_one_layer():
    """FSDP2 gathers layer i+1 while layer i computes: over n layers a part takes max(compute, link) plus one
    layer of the smaller. Without NVLink, the collectives and offload's copies share the PCIe link each way."""
    gpu = GPU(24.0, 100.0, memory_gbps=1000, nvlink_gbps=0.0, peer_to_peer=False)
    rates = Rates.of(gpu, matmul_efficiency=1.0)
    compute_bound = Work(matmul_flops=4e12, matmuls={(1e12, 1e6): 4.0}, gather_bytes=1e9, layers=4)
    time = part_time("forward", compute_bound, rates, offload=False)
    link = 1e9 / rates.pcie
    assert time.matmul == pytest.approx(0.04) and time.total == pytest.approx(0.04 + link / 4)
    assert time.exposed == pytest.approx(link / 4)
    link_bound = Work(matmuls={(1e9, 1e6): 4.0}, gather_bytes=4e9, to_gpu_bytes=4e9, to_host_bytes=1e9, layers=4)
    collectives, copies, shared = link_seconds(link_bound, rates)
    assert shared == pytest.approx(8e9 / rates.pcie)  # inbound: the other rank's half and the own copy
    assert (collectives, copies) == (pytest.approx(4e9 / rates.pcie), pytest.approx(4e9 / rates.pcie))
    compute = 4 * 1e9 / rates.flops
    assert part_time("forward", link_bound, rates, offload=False).total == pytest.approx(shared + compute / 4)
    assert part_time("loss", link_bound, rates, offload=False).total == pytest.approx(shared + compute)  # serial
    nvlink = Rates.of(GPU(80.0, 100.0, memory_gbps=1000, nvlink_gbps=300.0), matmul_efficiency=1.0)
    assert link_seconds(link_bound, nvlink)[2] == pytest.approx(max(4e9 / nvlink.nvlink, 4e9 / nvlink.pcie))
    memory_bound = Work(matmuls={(1e6, 1e9): 1.0})  # a rank-16 LoRA projection's shape of work: bytes win
    assert part_time("forward", memory_bound, rates, offload=False).matmul == pytest.approx(1e9 / rates.memory)
