"""The planner's measured step: its peak against the same step run for real, and a long model measured shorter
against the whole model."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import Glm4MoeConfig, LlamaConfig

from qlora_fsdp.config import Config, load_config
from qlora_fsdp.measure.fake_step import find_repeats, position
from tests.helpers import run_ranks


def architecture(folder: Path, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int) -> Path:
    """A Llama of these shapes as config.json alone: `model.init: random` needs no weights."""
    LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 16 * 16, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                max_position_embeddings=8192, tie_word_embeddings=False).save_pretrained(folder)
    return folder


def step_config(model_dir: Path, context: int, accumulation: int, *overrides: str) -> Config:
    """tiny_cpu's training setup (NF4, LoRA r=16 on every linear, paged 8-bit AdamW, packed rows, bf16) on a
    random-weight model, rank 0 of 2."""
    return load_config("tiny_cpu", [f"model.path={model_dir}", "model.init=random", "hardware.gpus_per_node=2",
                                    "model.dtype=bfloat16", "quant.compute_dtype=bfloat16",  # as on a GPU
                                    "data.micro_batch_size=1", f"data.context_length={context}",
                                    f"data.grad_accum_steps={accumulation}", *overrides])


# ---- a long model measured shorter: the split (no process needed) ---------------------------------------------

def test_layers_split_into_head_repeated_block_and_tail():
    wrapped, plain = (True, None), (False, None)
    first_last = find_repeats((wrapped,) + (plain,) * 10 + (wrapped,))
    assert (len(first_last.head), first_last.block, first_last.count, len(first_last.tail)) == (1, (plain,), 10, 1)
    every_third = find_repeats((wrapped, plain, plain) * 26 + (wrapped, plain))  # every_nth 3 on 80 layers
    assert every_third.block in {(wrapped, plain, plain), (plain, plain, wrapped), (plain, wrapped, plain)}
    # measured with the block 2 and 3 times (one edge repeat each side), or 4 and 5 under activation offload
    assert every_third.count == 26 and every_third.short_counts == (2, 3) and every_third.saved == (26 - 3) * 3
    assert find_repeats((wrapped, plain, plain) * 26 + (wrapped, plain), edge=2).saved == (26 - 5) * 3
    # the repeat at either end keeps its own label (a layer's neighbours change its step), the rest go
    uniform = find_repeats((wrapped,) * 80)
    labels = [position(layer, uniform) for layer in range(80)]
    assert labels[0] == ("block", "from start", 0, 0) and labels[-1] == ("block", "from end", 0, 0)
    assert labels[1:-1] == [None] * 78 and position(-1, uniform) == -1
    # under activation offload, the two at either end (it copies back the layer after next)
    offloaded = find_repeats((wrapped,) * 80, edge=2)
    labels = [position(layer, offloaded) for layer in range(80)]
    assert labels[:2] == [("block", "from start", 0, 0), ("block", "from start", 1, 0)]
    assert labels[-2:] == [("block", "from end", 1, 0), ("block", "from end", 0, 0)]
    assert labels[2:-2] == [None] * 76


# ---- planned against real ----------------------------------------------------------------------------------------

def planned_and_measured(info, configs):
    """On a fake rank of 2: per config, the plan's peak (fake step) and the same step's, run for real; and the
    planned forward's 4-bit elements dequantized, all and each weight once."""
    from qlora_fsdp.measure.fake_world import recipe_step
    from qlora_fsdp.measure.planning import Planning
    from qlora_fsdp.measure.real_step import measured_step

    out = []
    for cfg in configs:
        planned = recipe_step(Planning.of(cfg))
        forward = planned.work[(0, "forward")]
        out.append((planned.peak, measured_step(cfg, info).peak,
                    (forward.dequant_elements, forward.distinct_dequant_elements)))
    return out


@pytest.mark.slow
def test_planned_peak_is_the_real_steps(tmp_path):
    """Two scales (benchmarks/planner_memory.py runs larger ones: 36 settings up to 8 layers at 4,096 tokens), the
    loss, checkpointing, both offloads, tiles, DPO's step and DoRA varied, in bf16 as on a GPU: the planned peak of
    live tensor bytes is within 10% of the real step's (it comes out equal to a few KB: the same code runs, only the
    values differ; DoRA above, by up to 6%). export.target's rounding too: the planner's fake step rounds as the run
    does. Rows of 256 and 512 tokens: bf16 has no hardware on our CPUs, and the real step is most of the test's time."""
    small = architecture(tmp_path / "small", layers=4, hidden=256, heads=4, kv_heads=2, vocab=8192)
    medium = architecture(tmp_path / "medium", layers=6, hidden=384, heads=6, kv_heads=2, vocab=16384)
    cases = {
        "small (256 tokens), chunked loss, every layer": step_config(small, 256, 2, "loss.chunk_tokens=64"),
        "small, full loss, no checkpointing, activation offload": step_config(
            small, 256, 2, "loss.chunked=false", "activation_checkpointing.mode='off'",
            "activation_checkpointing.offload=true"),
        "medium (512 tokens), per-operator checkpointing, activation offload": step_config(
            medium, 512, 1, "activation_checkpointing.scope=ops", "activation_checkpointing.offload=true"),
        "small, 2 padded rows, FSDP2 CPU offload, attention checkpointed": step_config(
            small, 256, 1, "data.packing=false", "data.micro_batch_size=2", "fsdp_preset=full_shard_cpu_offload",
            "activation_checkpointing.scope=attention"),
        "small, DPO: the reference forward (adapter off, no grad) then the policy's, pair losses": step_config(
            small, 256, 2, "train.objective=dpo", "preference.reference=adapter_off", "loss.chunk_tokens=64"),
        "small, export.target q4_k_m: each linear's rounded weight, its searches and their temporaries": step_config(
            small, 256, 2, "loss.chunk_tokens=64", "export.target=q4_k_m", "lora.dropout=0.0"),
        "small, the attention side and the MLP in 64-token tiles": step_config(
            small, 256, 1, "activation_checkpointing.attention_tile_tokens=64",
            "activation_checkpointing.mlp_tile_tokens=64"),
    }
    # DoRA's peak is not deterministic, fake or real: the same fake step measured 26,805,416 to 27,460,776 B in one
    # process (28,611,752 B in CI), the real one 26,803,368 and 27,065,512 B; multiples of half PEFT's 256x256 fp32
    # eye apart (a reference cycle freed when the garbage collector runs, most likely): planned >= real is held
    dora = "small, DoRA: each base weight dequantized for its norm"
    cases[dora] = step_config(small, 256, 1, "lora.use_dora=true", "loss.chunk_tokens=64")
    results = run_ranks(planned_and_measured, 2, list(cases.values()), tmp_dir=tmp_path, fake=True)[0]
    for name, (planned, measured, _) in zip(cases, results, strict=True):
        assert abs(planned / measured - 1) <= 0.10, f"{name}: planned {planned:,} B, measured {measured:,} B"
        if name == dora:
            assert planned >= measured, f"{name}: planned {planned:,} B, measured {measured:,} B"
            continue
        assert abs(planned - measured) < 2**16, f"{name}: planned {planned:,} B, measured {measured:,} B"
    # the tiles dequantize each weight once a tile (4 tiles of 64 tokens); a decoding step, which the generation
    # plan prices from the forward, dequantizes each once: as the untiled forward of the same model does
    tiles = list(cases).index("small, the attention side and the MLP in 64-token tiles")
    whole, tiled = results[0][2], results[tiles][2]
    assert whole[0] == whole[1] > 0 and tiled[1] == whole[1] and tiled[0] == 4 * tiled[1], (whole, tiled)


def planned_peaks(info, configs):
    from qlora_fsdp.measure.fake_world import recipe_step
    from qlora_fsdp.measure.planning import Planning

    return [recipe_step(Planning.of(cfg)).peak for cfg in configs]


@pytest.mark.slow
def test_attention_side_tiles_lower_the_planned_peak(tmp_path):
    """A 2,048-token row (hidden 512, MLP already tiled): the attention side in 256-token tiles plans a lower peak
    than whole (the norms' fp32 copies and LoRA's intermediates for one tile at a time): 84.5 -> 67.0 MB planned.
    A fused q/k/v group kept under tiles held a view of each layer's normed row: 74.5 MB."""
    model = architecture(tmp_path / "m", layers=4, hidden=512, heads=8, kv_heads=2, vocab=8192)
    whole, tiled = (step_config(model, 2048, 1, "loss.chunk_tokens=64", "activation_checkpointing.mlp_tile_tokens=256",
                                f"activation_checkpointing.attention_tile_tokens={tile}") for tile in (0, 256))
    whole_peak, tiled_peak = run_ranks(planned_peaks, 2, [whole, tiled], tmp_dir=tmp_path, fake=True)[0]
    assert tiled_peak < 0.85 * whole_peak, (whole_peak, tiled_peak)


def planned_in_a_fake_world_and_measured(info, cfg):
    from qlora_fsdp.measure.fake_world import in_real_world, recipe_step
    from qlora_fsdp.measure.planning import Planning
    from qlora_fsdp.measure.real_step import measured_step

    assert in_real_world()
    return recipe_step(Planning.of(cfg)).peak, measured_step(cfg, info).peak


@pytest.mark.slow
def test_a_launched_run_plans_in_a_fake_world_of_its_own(tmp_path):
    """A run already in a real process group (one gloo rank here; torchrun's ranks at launch, sizing an auto
    micro-batch) plans in a fresh process: the fake step's collectives never reach the real group. One process,
    no FSDP2 wrap: torch's plain tracker, the peak again the real step's."""
    small = architecture(tmp_path / "small", layers=4, hidden=256, heads=4, kv_heads=2, vocab=8192)
    cfg = step_config(small, 256, 2, "hardware.gpus_per_node=1")
    planned, measured = run_ranks(planned_in_a_fake_world_and_measured, 1, cfg, tmp_dir=tmp_path)[0]
    assert abs(planned - measured) < 2**16, (planned, measured)


# ---- a long model measured shorter: the figures ---------------------------------------------------------------

def whole_and_shortened(info, configs, accumulating):
    """Per config: the step's figures from the whole model and from the shortened runs; then a step with three
    micro-batches (a middle one, sync off, with gradients already accumulated) against the planner's two."""
    from qlora_fsdp.measure import fake_step
    from qlora_fsdp.objectives.base import Objective
    from qlora_fsdp.run.description import planned_run

    def figures(step):
        return step.model, step.loss, step.optimizer, step.own_loss_bytes, step.offloaded, step.peak

    out = []
    for cfg in configs:
        hf_config = planned_run(cfg).hf_config
        assert fake_step.find_repeats(fake_step.layer_kinds(cfg, hf_config)).saved > 0
        whole = fake_step.measure_fake_step(cfg, hf_config, info.mesh)
        shortened = fake_step.planned_step(cfg, hf_config, info.mesh, whole_model_layers=0)
        out.append((figures(whole), figures(shortened)))
    two = fake_step.measure_fake_step(accumulating, planned_run(accumulating).hf_config, info.mesh)
    planned_micro_batches, Objective.PLANNED_MICRO_BATCHES = Objective.PLANNED_MICRO_BATCHES, 3
    try:
        three = fake_step.measure_fake_step(accumulating, planned_run(accumulating).hf_config, info.mesh)
    finally:
        Objective.PLANNED_MICRO_BATCHES = planned_micro_batches  # the pool's worker serves other tests next
    return out, (figures(two), figures(three))


@pytest.mark.slow
def test_shortened_runs_give_the_whole_models_figures(tmp_path):
    """12 layers measured with their repeated block 2 and 3 times (4 and 5 under activation offload) and continued:
    every phase's peak, the loss's own bytes and the offloaded bytes equal the whole model's, for a uniform policy
    with activation offload, an edged and a periodic one (one edge repeat was measured to differ under offload), and
    a mixture of experts whose first layer is dense (its layers differ in shape, not in type or policy). And
    a third micro-batch (sync off, gradients accumulated) reaches no higher than the planner's two."""
    model_dir = architecture(tmp_path / "twelve", layers=12, hidden=64, heads=2, kv_heads=1, vocab=512)
    configs = [
        step_config(model_dir, 128, 2, "loss.chunked=false", "activation_checkpointing.offload=true"),
        step_config(model_dir, 128, 1, "activation_checkpointing.mode=first_last",
                    "activation_checkpointing.scope=attention"),
        step_config(model_dir, 128, 1, "activation_checkpointing.mode=every_nth", "activation_checkpointing.every_n=2",
                    "fsdp_preset=full_shard_cpu_offload"),
    ]
    # a dense first layer before 7 MoE ones (GLM-4.5's, DeepSeek-V3's): the block is the MoE layer, the dense one's
    # neighbour an edge repeat of its own
    Glm4MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=8,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                  n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                  vocab_size=512).save_pretrained(tmp_path / "dense_first")
    configs.append(step_config(tmp_path / "dense_first", 128, 1))
    four = architecture(tmp_path / "four", layers=4, hidden=64, heads=2, kv_heads=1, vocab=512)
    accumulating = step_config(four, 128, 3, "activation_checkpointing.offload=true")
    results, (two, three) = run_ranks(whole_and_shortened, 2, configs, accumulating, tmp_dir=tmp_path, fake=True)[0]
    for index, (whole, shortened) in enumerate(results):
        assert whole == shortened, f"policy {index}"
    assert two == three


# ---- attention in memory linear in the row -------------------------------------------------------------------

LINEAR_FAMILIES = ("gpt_oss", "gemma2", "gemma3", "mistral", "qwen3")  # sinks, soft-capping, windows


def planned_at_lengths_and_measured_at_the_ends(info, configs_by_family):
    """Per family: the planned peaks at each length, and the real step's at the shortest and the longest; the
    attention's blocks of 64 tokens (512 by default: a row within one block holds its square)."""
    from qlora_fsdp.layers import blockwise_attention
    from qlora_fsdp.measure.fake_world import recipe_step
    from qlora_fsdp.measure.planning import Planning
    from qlora_fsdp.measure.real_step import measured_step

    default, blockwise_attention.BLOCK_TOKENS = blockwise_attention.BLOCK_TOKENS, 64
    try:
        return {family: ([recipe_step(Planning.of(cfg)).peak for cfg in configs],
                         [measured_step(cfg, info).peak for cfg in (configs[0], configs[-1])])
                for family, configs in configs_by_family.items()}
    finally:
        blockwise_attention.BLOCK_TOKENS = default  # the pool's worker serves other tests next


@pytest.mark.slow
def test_every_familys_step_peak_grows_linearly_in_the_row(tmp_path):
    """Windows (16 tokens), sinks and soft-capping on one 128-, 256- and 512-token packed row, no checkpointing (so
    every layer's attention is live at once): the planned peak is the real step's at both ends, and it grows by
    the same bytes per token from 256 to 512 as from 128 to 256 (the dense kernel's scores, 4 heads x 512^2 fp32
    per layer, more than doubled that step: Gemma 2 +2.4 MB then +6.8 MB)."""
    from qlora_fsdp.tools.tiny_model import train_tokenizer
    from tests.families import write_family_model

    tokenizer = train_tokenizer(Path("data/tiny_instruct.jsonl"), 512)
    lengths = (128, 256, 512)
    configs = {family: [step_config(write_family_model(tmp_path / family, family, tokenizer), n, 1,
                                    "model.dtype=float32", "quant.compute_dtype=float32",
                                    "activation_checkpointing.mode='off'", "loss.chunked=false")
                        for n in lengths]
               for family in LINEAR_FAMILIES}
    results = run_ranks(planned_at_lengths_and_measured_at_the_ends, 2, configs, tmp_dir=tmp_path, fake=True)[0]
    for family, (planned, measured) in results.items():
        for at, real in zip((planned[0], planned[-1]), measured, strict=True):
            assert abs(at / real - 1) <= 0.10, f"{family}: planned {at:,} B, measured {real:,} B"
        first, second = planned[1] - planned[0], planned[2] - planned[1]  # per 128 tokens, then per 256
        assert 1.8 <= second / first <= 2.2, f"{family}: +{first:,} B then +{second:,} B ({planned})"
