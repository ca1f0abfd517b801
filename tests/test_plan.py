"""The memory planner: exact against what a sharded run really holds; the 70B verdicts from config.json alone."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from qlora_fsdp.config import load_config
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.objectives.supervised import accumulate_gradients
from qlora_fsdp.plan.recipe_table import HEADER, readme_table, recipe_names
from tests import planners
from tests.helpers import REPO, batches, fsdp_params, run_ranks_sequence, tiny_config, variable_length_samples

PAD = 2


def tensor_bytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def unsharded_grad_bytes(model) -> int:
    """Bytes of the gradients FSDP2 holds unsharded between micro-batches."""
    total = 0
    for fsdp_param in fsdp_params(model):
        grad = fsdp_param.unsharded_accumulated_grad
        if grad is None and hasattr(fsdp_param, "_unsharded_param"):
            grad = fsdp_param._unsharded_param.grad
        total += tensor_bytes([grad])
    return total


def measured_and_planned(info, cfg, micro_batches_per_rank):
    """Bytes rank 0 holds, by kind, next to the planner's figures: the gradients FSDP2 keeps unsharded just before
    the last micro-batch (sync off until then), the rest after one real optimizer step."""
    import qlora_fsdp.objectives.supervised as supervised
    from qlora_fsdp.distributed import local_shard
    from qlora_fsdp.measure.held import accumulating_gradient_bytes, meta_held, quant_state_bytes
    from qlora_fsdp.measure.planning import Planning
    from qlora_fsdp.measure.real_step import held_quant_state_bytes
    from qlora_fsdp.optimizer import build_optimizer

    model = build_sharded_model(cfg, info)
    optimizer = build_optimizer(model, cfg.optim, cfg.lora)
    measured = {"lora": 0, "grads": 0, "base": 0, "optimizer": 0, "quant_state": 0, "accumulating": 0}
    original_sync = supervised.set_gradient_sync

    def measuring_sync(model, enabled):
        if enabled:  # the last micro-batch is next: every earlier one ran with sync off
            measured["accumulating"] = unsharded_grad_bytes(model)
        original_sync(model, enabled)

    supervised.set_gradient_sync = measuring_sync
    try:
        accumulate_gradients(model, micro_batches_per_rank[info.rank], info.device)
    finally:
        supervised.set_gradient_sync = original_sync
    optimizer.step()  # state exists after the first step
    for param in model.parameters():
        if param.requires_grad:
            measured["lora"] += tensor_bytes([local_shard(param)])
            measured["grads"] += tensor_bytes([local_shard(param.grad)])
        else:
            measured["base"] += tensor_bytes([local_shard(param)])
    measured["optimizer"] = sum(tensor_bytes(state.values()) for state in optimizer.inner.state.values())
    measured["quant_state"] = sum(held_quant_state_bytes(module.quant_state) for module in model.modules()
                                  if getattr(module, "quant_state", None) is not None)
    held = meta_held(Planning.of(cfg), info.mesh)
    planned = {"lora": held.lora, "grads": held.grads, "base": held.base_4bit + held.other_base,
               "optimizer": held.optimizer, "quant_state": held.quant_state,
               "accumulating": accumulating_gradient_bytes(held, cfg)}
    assert quant_state_bytes(64 * 64, 64, False) == 64 * 4 + 64  # absmax per block + the 16-value code
    return measured, planned


# optimizer, LoRA dtype, FSDP2 compute and reduce dtypes, trained embeddings: accumulation in fp32 (no policy), upcast
# from bf16 LoRA, and in bf16 (reduce dtype = compute dtype, so FSDP2 keeps the compute dtype); the embeddings and
# head trained beside LoRA, grown by two tokens, their state 32-bit under the 8-bit optimizer
PLANNED_SETUPS = [("paged_adamw_8bit", "float32", None, "float32", False),
                  ("adamw", "bfloat16", None, "float32", False),
                  ("paged_adamw_8bit", "float32", "bfloat16", "bfloat16", False),
                  ("paged_adamw_8bit", "float32", None, "float32", True)]


@pytest.mark.old_torch  # run on torch 2.11 too (make test-old-torch)
@pytest.mark.slow
def test_planned_sizes_equal_measured(tiny_model_dir, tmp_path):
    """Byte for byte, after a step and mid-accumulation (2 micro-batches a rank)."""
    # r=64 makes the LoRA shards large enough for bitsandbytes' 8-bit state (4096+ elements); r=16 stays 32-bit
    calls = []
    for optimizer, lora_dtype, param_dtype, reduce_dtype, embeddings in PLANNED_SETUPS:
        cfg = tiny_config(tiny_model_dir, optim={"name": optimizer},
                          model={"dtype": "bfloat16", "add_tokens": ["<new1>", "<new2>"] if embeddings else []},
                          lora={"r": 64, "alpha": 128, "dtype": lora_dtype, "train_embeddings": embeddings},
                          data={"grad_accum_steps": 2}, fsdp={"param_dtype": param_dtype, "reduce_dtype": reduce_dtype})
        samples = variable_length_samples(cfg, 8)
        calls.append((measured_and_planned, (cfg, [batches(samples[:4], 2, PAD), batches(samples[4:], 2, PAD)])))
    run_results = run_ranks_sequence(calls, 2, tmp_path)
    for setup, (measured, planned) in zip(PLANNED_SETUPS, run_results, strict=True):
        assert measured == planned and all(measured.values()), setup
    measured, _ = run_results[0]  # fp32 throughout: the accumulating gradients are both ranks' shards
    assert measured["accumulating"] == 2 * measured["grads"]


# every shipped recipe's plan (scripts/recipe_table.py --json) and the 70B test's own plans (tests/planners.py, with
# test_step_time's published runs, in one process): minutes of a core, so they run beside the tests before them
# (tests/background.py), and only the representative recipes where the record's inputs are today's
# (tests/plan_record.py)
planners.register()


@pytest.fixture(scope="module")
def recipe_plans() -> dict:
    return json.loads(planners.part("recipe_plans"))


@pytest.fixture(scope="module")
def plans_70b() -> str:
    return planners.part("plans_70b")


@pytest.mark.slow
def test_the_recorded_plans_are_current_and_equal_todays(recipe_plans):
    """The planner job answered from tests/fixtures/recipe_plans.json only where every input it lists (the repo's
    modules the planner imported, the recipes and model configs, the pinned packages) is unchanged; the
    representative recipes planned today equal their recorded plans to the last digit (an input the fingerprint
    missed would show here), all of them under QLORA_REPLAN=1."""
    from tests.plan_record import REPRESENTATIVE

    job = planners.planned("recipe_plans")
    assert not job["stale"], ("the recorded plans are stale (" + ", ".join(job["stale"][:6]) + "): run "
                              "`make recipe-plans` and commit tests/fixtures/recipe_plans.json")
    assert set(REPRESENTATIVE) <= set(job["fresh"]) and set(REPRESENTATIVE) <= set(recipe_plans)
    recorded = json.loads(job["recorded"]["recipe_plans"])
    for name in job["fresh"]:
        assert recipe_plans[name] == recorded[name], f"{name}: planned today unlike its record, with the same inputs"
    if job["replanned"]:  # forced: every part the selected tests read, not only the recipes

        def unplaced(text: str) -> str:  # the 70B part's 8B config lives in a scratch folder of each run
            return re.sub(r"\S*/(8b-2-layers)", r"\1", text)

        for part in set(job["outputs"]) - {"recipe_plans"}:
            assert unplaced(job["outputs"][part]) == unplaced(job["recorded"][part]), part


@pytest.mark.slow
def test_70b_plans_from_config_json_alone(plans_70b, recipe_plans):
    """2x RTX 4090: DOES NOT FIT without offload (and offload is named as the fix), FITS with it; the step's rows
    are measured, the chunked loss takes under 0.5 GiB. 2 nodes x 8 in HSDP: the shard is over a node's 8 GPUs,
    the auto micro-batch and scaled lr are printed, FITS. An 8B with full logits on 12 GiB: the chunked loss is
    the first fix named, with its total (the 8B's shapes, 2 of its layers)."""
    lines = plans_70b.splitlines()
    assert lines[0].startswith("full_shard DOES NOT FIT") and float(lines[0].split()[-1]) > 24
    assert lines[1].startswith("full_shard_cpu_offload FITS") and float(lines[1].split()[-1]) < 24
    assert lines[2].startswith("70.55B base parameters")
    assert lines[3].startswith("['fsdp_preset=full_shard_cpu_offload")  # the only single fix, and it is named

    rows = [line.split(maxsplit=3)[1:] for line in lines if line.startswith("row ")]
    assert {basis for basis, _, name in rows if not name.startswith("CUDA context")} == {"exact", "measured"}
    logits = next((float(gib), name) for basis, gib, name in rows if name.startswith("logits and loss"))
    own = float(logits[1].split("; ")[1].split()[0])  # the loss's own bytes, given in the row's name
    assert logits[0] <= 0.5 and 0 < own <= 0.5, logits
    # at least the 80 layers' checkpointed inputs (80 x 2048 x 8192 x 2 bytes), in the table when they make the
    # peak, else in the line under it (the peak can be the start of a forward, the root's gathers alive)
    activations = next(float(gib) for _, gib, name in rows if name.startswith("activations"))
    note = lines[len(rows) + 4]
    if note != "largest activations: None":
        assert note.startswith("largest activations: activations and temporaries are largest elsewhere: "), note
        assert "micro-batch's backward of the last layers" in note, note
        activations = float(note.split("elsewhere: ")[1].split()[0])
    assert 2.5 < activations < 8

    hsdp = recipe_plans["llama70b_hsdp_2x8x4090"]["report"].splitlines()
    assert hsdp[0].endswith("on 16 x rtx4090 (24 GiB): 70.55B base parameters, world size 16, weights bfloat16, "
                            "4-bit compute bfloat16")  # auto, resolved for the recipe's GPU
    shard_row = next(line for line in hsdp if line.startswith("| 4-bit base weights"))
    h, kv, inter, layers = 8192, 1024, 28672, 80  # model_configs/llama-3.1-70b
    packed_bytes = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) / 2  # two 4-bit values a byte
    assert float(shard_row.split("|")[2]) == pytest.approx(packed_bytes / 8 / 2**30, abs=0.01)  # over 8, not 16
    batch = next(line for line in hsdp if line.startswith("batch:"))
    assert "x 16 ranks = 64 rows a step" in batch and f"lr {1e-4 * math.sqrt(2):.3g} (sqrt scaling" in batch
    assert "FITS" in hsdp and "DOES NOT FIT" not in hsdp

    eight_b = lines[len(rows) + 5:]
    assert eight_b[eight_b.index("DOES NOT FIT") + 1].startswith("changes that make it fit")
    fixes = [line.strip()[2:] for line in eight_b if line.startswith("  - ")]
    # each fix with its memory and its cost in speed (the chunked loss recomputes the output layer in backward)
    assert re.fullmatch(r"loss\.chunked=true: [\d.]+ GiB a GPU, \+\d+% time a token", fixes[0]), fixes
    assert float(fixes[0].split(": ")[1].split()[0]) < 12


def test_mfu_counts_6n_flops_a_token_and_8n_with_dpos_reference_forward():

    from qlora_fsdp.training.records import MfuReference

    unknown = MfuReference.for_run(70_553_706_496, None, world_size=2)  # unknown device (CPU): no MFU reported
    assert unknown.mfu(477.0) is None
    reference = MfuReference.for_run(70_553_706_496, 165.2e12, world_size=2)
    # Answer.AI's published 70B run: 477 tokens/s on 2x RTX 4090
    assert reference.mfu(477.0) == pytest.approx(477.0 * 6 * 70_553_706_496 / (2 * 165.2e12))
    assert 0.60 < reference.mfu(477.0) < 0.62
    # DPO with the reference as a forward each micro-batch (adapter off): 8N a token
    with_reference = reference.with_forwards(1)
    assert with_reference.mfu(477.0) == pytest.approx(477.0 * 8 * 70_553_706_496 / (2 * 165.2e12))


@pytest.mark.slow
def test_recipes_no_peer_has_plan_fits_within_their_host_budgets(recipe_plans):
    """A 70B on one 24 GB GPU in 64 GiB of host RAM; a 70B on two at 64k tokens or more in 128 GiB (each row split
    over both); an 8B on one at 128k or more in 64 GiB (Unsloth publishes 78,475; its MLP and attention side tiled,
    its model offloaded), on two at 256k or more in 128 GiB; Qwen3-30B-A3B and gpt-oss-20b on one at 64k or more in
    64 GiB; Gemma 3 27B on two at 32k or more in 64 GiB; a 32B on Kaggle's two 16 GB T4s (15 GiB usable) in
    29 GiB, in float16 (no bf16 on a T4)."""
    expected = {"llama70b_1x4090": (1, 2048, 64, 24, "bfloat16"),
                "llama70b_2x4090_long": (2, 65536, 128, 24, "bfloat16"),  # each row split over both GPUs
                "llama3_8b_2x4090_long": (2, 262144, 128, 24, "bfloat16"),  # likewise
                "qwen3_30b_a3b_1x24gb_long": (1, 65536, 64, 24, "bfloat16"),  # its experts tiled
                "gpt_oss_20b_1x24gb_long": (1, 65536, 64, 24, "bfloat16"),  # windows, sinks, experts tiled
                "gemma3_27b_2x4090_long": (2, 32768, 64, 24, "bfloat16"),  # windows, each row split over both
                "llama3_8b_1x4090_long": (1, 131072, 64, 24, "bfloat16"),
                "qwen2.5_32b_2xt4": (2, 2048, 29, 15, "float16")}
    for name, (world, min_context, host_budget, gpu_gib, dtype) in expected.items():
        got = recipe_plans[name]
        assert (got["world_size"], got["fits"], got["host_capacity_gib"], got["gpu_capacity_gib"], got["dtype"]) == (
            world, True, host_budget, gpu_gib, dtype), got
        assert got["context_length"] >= min_context and got["gpu_gib"] <= gpu_gib and got["host_gib"] <= host_budget


@pytest.mark.slow
def test_every_shipped_recipe_fits_and_the_readme_shows_its_plan(recipe_plans):
    """The README's recipe table is what the planner says today, row for row (scripts/recipe_table.py --write
    remakes it), every shipped recipe fits its hardware, and a recipe header's `# Planned:` line is its plan."""
    plans = recipe_plans
    assert sorted(plans) == recipe_names()
    assert [name for name, got in plans.items() if not got["fits"]] == []
    rows = "\n".join(plans[name]["row"] for name in recipe_names())
    assert readme_table(REPO / "README.md") == "\n".join([*HEADER, rows]), "run: python scripts/recipe_table.py --write"
    headed = 0
    for name in recipe_names():
        said = [line for line in (REPO / "recipes" / f"{name}.yaml").read_text().splitlines()
                if line.startswith("# Planned:")]
        got = plans[name]
        for line in said:
            headed += 1
            assert line.startswith(f"# Planned:  FITS: {got['gpu_gib']:.2f} GiB a GPU of {got['gpu_capacity_gib']:g}, "
                                   f"{got['host_gib']:.2f} GiB of host RAM of {got['host_capacity_gib']:g} "), name
    assert headed >= 2  # the DPO recipes say theirs


@pytest.mark.slow
def test_every_shipped_recipe_plans_its_time(recipe_plans):
    """--plan's time lines: the parts add up to the step (compute, the update, the transfers left exposed), the
    tokens/s and the hours follow from it, and the epoch is priced from the recipe's record count."""
    for name, got in recipe_plans.items():
        report = got["report"]
        step = float(re.search(r"^\| \*\*step\*\* \| \*\*([\d.]+)\*\* \|$", report, re.M).group(1))
        adding = [float(x) for x in re.findall(r"^\| (?:matmuls|attention|element-wise|4-bit|optimizer|transfers left"
                                              r"|generation|the vision tower)[^|]*\| ([\d.]+) \|$", report, re.M)]
        cfg = load_config(name)
        grpo = cfg.train.kind.generates  # generating is a part of its step (GRPO, RLOO)
        images = bool(cfg.data.images_per_row)  # so is the vision tower's forward
        assert len(adding) == 6 + grpo + images and sum(adding) == pytest.approx(step, abs=0.05), name
        line = re.search(r"^([\d,]+) (?:trained )?tokens a step: ([\d,]+) tokens/s, MFU \d+% .*train.max_steps (\d+): "
                         r"([\d.]+) (h|min)$", report, re.M)
        tokens, rate, max_steps, hours, unit = line.groups()
        assert float(rate.replace(",", "")) == pytest.approx(float(tokens.replace(",", "")) / step, rel=0.01)
        per_unit, printed = (3600, 0.06) if unit == "h" else (60, 0.6)  # hours to a tenth, minutes whole
        assert float(hours) == pytest.approx(int(max_steps) * step / per_unit, abs=printed), name
        assert f"| {rate} |" in got["row"]  # the README's table shows it
        assert re.search(rf"^one epoch of [\d,]+ {'prompts' if grpo else 'records'}: ", report, re.M), name
        # DPO's and KTO's reference forward each micro-batch where it may run: 2N more
        reference_forward = (cfg.train.objective in ("dpo", "kto") and cfg.preference.reference != "precomputed"
                             and not cfg.model.adapter and not cfg.lora.train_router)
        flops = 8 if reference_forward else 6
        moe = re.search(r"\(([\d.]+B) active a token\)", report.splitlines()[0])  # MFU counts active parameters
        generated = ", 2N a generated one" if grpo else ""
        assert f"({flops}N FLOP a token{generated}{', N the active parameters' if moe else ''})" in report, name
        link = "PCIe 4.0 x16, no peer-to-peer: collectives through host memory" if "4090" in name else "PCIe"
        assert re.search(rf"^time per optimizer step on \d+ x {cfg.hardware.gpu} \({link}", report, re.M), name


def test_the_plan_names_where_its_peak_is_and_where_activations_are_largest():
    """The table's rows are one instant of the step; a line under it says where activations peak when that is
    another instant (a shortened model's block positions read as the first or last layers)."""
    from qlora_fsdp.measure.step_tracker import Moment, StepMemory
    from qlora_fsdp.plan.memory import activations_peak_line, instant_words

    gib = 2**30
    start = (1, "forward", ("block", "from start", 0, 0))
    end = (0, "backward", ("block", "from end", 0, 0))
    step = StepMemory({start: Moment(10 * gib, 8 * gib, 1 * gib), end: Moment(9 * gib, 4 * gib, 0),
                       (0, "loss", -1): Moment(12 * gib, 0, 0)}, {0: 0})
    assert step.model_instant() == start and step.activations_instant == end  # the loss is not forward or backward
    assert instant_words(start) == "the second micro-batch's forward of the first layers"
    assert instant_words((0, "backward", 3)) == "the first micro-batch's backward of layer 4"
    assert activations_peak_line(step) == ("activations and temporaries are largest elsewhere: 5.00 GiB in the "
                                           "first micro-batch's backward of the last layers, where the device "
                                           "holds 1.00 GiB less than at the peak above")
    # what the device holds throughout (the weights of a model that is not offloaded) is not activations
    assert activations_peak_line(step, resident=2 * gib).startswith("activations and temporaries are largest "
                                                                    "elsewhere: 3.00 GiB in the first")
    step.segments[end] = Moment(11 * gib, 4 * gib, 0)  # now the peak itself: the table says it all
    assert step.model_instant() == end and activations_peak_line(step) is None


def test_generations_kv_cache_is_what_transformers_generate_keeps():
    """GRPO's plan counts the KV cache from the architecture: it equals the cache transformers' generate holds at
    the end (rows x (prompt + new - 1) tokens: the last token's keys are never computed), and a sliding-window
    layer keeps its window (transformers keeps window - 1 between steps, window while appending: the plan takes
    the larger)."""
    import transformers

    from qlora_fsdp.generation.room import kv_cache_bytes

    torch.manual_seed(0)
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)
    gemma = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                          layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    rows, prompt, new = 3, 5, 6
    for config, sliding_layers in ((llama, 0), (gemma, 2)):
        model = transformers.AutoModelForCausalLM.from_config(config)
        out = model.generate(torch.randint(1, 60, (rows, prompt)), max_new_tokens=new, min_new_tokens=new,
                             do_sample=True, return_dict_in_generate=True, pad_token_id=0)
        held = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers
                   for t in (layer.keys, layer.values))
        token = rows * 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4
        assert kv_cache_bytes(config, rows, prompt + new - 1, 4) == held + sliding_layers * token


def test_long_rows_are_offered_the_tiled_mlp():
    """A recipe with rows longer than 8,192 tokens, its MLP whole and no LoRA dropout, gets the tiled MLP among the
    levers tried for a misfit; short rows, an MLP already tiled and LoRA dropout do not."""
    import dataclasses

    from qlora_fsdp.plan.levers import memory_levers

    def offered(cfg) -> bool:
        return any("activation_checkpointing.mlp_tile_tokens" in values for _, values in memory_levers(cfg))

    long = load_config("llama3_8b_1x4090_long", ["activation_checkpointing.mlp_tile_tokens=0"])
    assert offered(long)
    assert not offered(load_config("llama3_8b_1x4090_long"))  # already tiled
    assert not offered(dataclasses.replace(long, data=dataclasses.replace(long.data, context_length=4096)))
    assert not offered(dataclasses.replace(long, lora=dataclasses.replace(long.lora, dropout=0.05)))


def test_long_rows_on_several_gpus_are_offered_context_parallel():
    """Rows longer than 8,192 tokens on a node of 2 GPUs get the split over both offered, for every objective; one
    GPU, short rows, rows already split over the node, or GRPO's tool rollouts (not split yet) do not."""
    from qlora_fsdp.plan.levers import memory_levers

    def offered(recipe: str, *overrides: str) -> bool:
        cfg = load_config(recipe, list(overrides))
        return any(values == {"fsdp.context_parallel": 2} for _, values in memory_levers(cfg))

    assert offered("llama70b_2x4090_long", "fsdp.context_parallel=1")
    assert not offered("llama3_8b_1x4090_long")  # one GPU
    assert not offered("llama70b_2x4090_long", "fsdp.context_parallel=1", "data.context_length=8192")
    assert not offered("llama70b_2x4090_long")  # split already
    assert offered("llama70b_2x4090_dpo", "data.context_length=16384")
    assert offered("qwen3_32b_2x4090_grpo", "data.context_length=16384")
    assert not offered("qwen3_32b_2x4090_grpo_tools", "data.context_length=16384")
