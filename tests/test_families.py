"""Every family, exact against transformers + bitsandbytes NF4 (tests/families.py builds them; windows of 16 tokens,
shorter than every sample here).

Per family, one pool task at world size 1 and one at 2 hold all of our side: the held-out loss of the same samples
packed into rows and padded one a row, one step's LoRA gradients (with B nonzero, so A's gradients are not zero),
the logits of one sample, and the adapter saved (world size 2) and sampled from (world size 2). The test process
holds the reference: transformers' own NF4 model of the checkpoint's own class (the multimodal one for the Gemma 3
multimodal checkpoint) with PEFT loading our adapter, and our merge loaded by transformers. fp32 throughout."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import peft
import pytest
import torch
import transformers
from peft import PeftModel
from transformers import AutoConfig, PreTrainedTokenizerFast

from qlora_fsdp.config.loader import to_yaml
from qlora_fsdp.data.batching import Sample, collate, collate_packed
from qlora_fsdp.distributed import all_reduce_sums
from qlora_fsdp.loading.adapter import adapter_file_key, export_adapter, peft_adapter_key
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.loading.fill import model_layout
from qlora_fsdp.loading.names import clean_name
from qlora_fsdp.loading.placement import copy_full_into
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.losses.pair_losses import adapter_off
from qlora_fsdp.tools.adapter_merge import merge_adapter
from qlora_fsdp.tools.adapter_sampling import Sampling, load_generator
from qlora_fsdp.tools.tiny_model import train_tokenizer
from tests.families import FAMILIES, MOE_FAMILIES, write_family_model
from tests.helpers import (
    REPO,
    decoder_lora_keys,
    full_grads,
    run_ranks,
    tiny_config,
    transformers_nf4,
    variable_length_samples,
)

pytestmark = pytest.mark.slow  # ranks on gloo
N_SAMPLES = 6
GENERATED = 6  # new tokens of GRPO's generation, compared with transformers' generate
# GRPO's fused decoding kernels (Triton, interpreted on the CPU) for a dense, a sliding-window and an MoE family
FUSED_KERNEL_FAMILIES = ("llama", "mistral", "qwen3_moe")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer(REPO / "data" / "tiny_instruct.jsonl", 512)


# the mixtures of experts whose matrix runs train LoRA on the experts and the routers too (Qwen3-MoE stores its
# experts [out, in], gpt-oss [in, out] with biases and a router bias, Llama 4 [in, out] called stacked, its router
# an nn.Linear, the multimodal checkpoint's too); the others keep LoRA on attention alone
TRAINS_EXPERTS = ("qwen3_moe", "gpt_oss", "llama4_text", "llama4")


def family_config(model_dir: Path, out: Path, attention_tiles: int = 0):
    lora = {"r": 4, "dropout": 0.0}
    if AutoConfig.from_pretrained(model_dir).model_type in TRAINS_EXPERTS:
        lora |= {"target_experts": True, "train_router": True}
    return tiny_config(model_dir, data={"packing": True}, train={"output_dir": str(out)}, lora=lora,
                       activation_checkpointing={"attention_tile_tokens": attention_tiles})


def nonzero_lora_b(model: torch.nn.Module) -> None:
    """B seeded by name (the same on every world size): with B = 0, A's gradient and the adapter's effect are 0."""
    for name, param in model.named_parameters():
        if "lora_B" in name:
            generator = torch.Generator().manual_seed(zlib.crc32(clean_name(name).encode()))
            copy_full_into(param, 0.1 * torch.randn(param.shape, generator=generator))


def summed(model, batch, info) -> float:
    with torch.no_grad():
        return ForwardLoss()(model, batch, info.device).item()


def our_side(info, model_dir: Path, out: Path, samples: list[Sample], adapter: Path | None,
             attention_tiles: int = 0) -> dict:
    """Everything our code computes for one family at one world size (a pool task)."""
    cfg = family_config(model_dir, out, attention_tiles)
    model = build_sharded_model(cfg, info)
    mine = samples[info.rank :: info.world_size]
    packed, padded = collate_packed([mine[: len(mine) // 2], mine[len(mine) // 2 :]], 0), collate(mine, 0)
    n_targets = sum(sum(label != -100 for label in s.labels[1:]) for s in samples)
    losses = all_reduce_sums([summed(model, packed, info), summed(model, padded, info)], info.device)  # the base's
    nonzero_lora_b(model)
    with adapter_off(model):  # DPO's reference: every LoRA off, the experts' too
        (off,) = all_reduce_sums([summed(model, packed, info)], info.device)
    q_runs = [0]  # the first attention layer's query projection's 4-bit matmuls in the step (Phi-3's fused qkv)
    query = next(m for name, m in model.named_modules()
                 if re.search(r"layers\.\d+\.(.+\.)?(q|qkv|q_a)_proj\.base_layer$", name))
    handle = query.register_forward_hook(lambda *_: q_runs.__setitem__(0, q_runs[0] + 1))
    train_loss = ForwardLoss.for_config(cfg, info.device)(model, packed, info.device) / n_targets
    train_loss.backward()  # training's loss: chunked, checkpointed, one sample at a time in each packed row
    handle.remove()
    layout = model_layout(model)
    grads = {adapter_file_key(name, layout): grad for name, grad in full_grads(model).items()}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([samples[0].input_ids], device=info.device)).logits.cpu()
    result = {"packed": losses[0] / n_targets, "padded": losses[1] / n_targets, "grads": grads, "logits": logits,
              "adapter_off": off / n_targets, "q_runs": q_runs[0], **completions_by_layout(model, cfg, info, samples)}
    if adapter is not None:  # saved, then sampled from on these ranks
        export_adapter(model, load_tokenizer(cfg), adapter, str(model_dir), info.is_main, to_yaml(cfg))
        generator = load_generator(cfg, adapter)
        result["reply"] = generator.token_ids("Name a colour.", Sampling(max_new_tokens=6))
        with torch.no_grad():
            result["generator_logits"] = generator.model(input_ids=torch.tensor([samples[0].input_ids])).logits
    return result


def generation_prompts(samples: list[Sample]) -> list[list[int]]:
    """Two prompts of different lengths (left padding where they share a call), one a rank at world size 2."""
    return [samples[0].input_ids[:11], samples[1].input_ids[:7]]


def completions_by_layout(model, cfg, info, samples: list[Sample]) -> dict:
    """GRPO's generation of both prompts in each layout the world size has: greedy, and sampled from one seed; for
    the fused kernels' families, both again through the kernels."""
    from qlora_fsdp.generation.layouts import LAYOUTS
    from qlora_fsdp.objectives.rollouts import generate
    from tests.helpers import generation_plan

    tokenizer = load_tokenizer(cfg)
    mine = generation_prompts(samples)[info.rank :: info.world_size]
    # the kernels at world size 2 only: its gathered layout decodes the whole model as world size 1 does
    fused = model.config.model_type in FUSED_KERNEL_FAMILIES and info.world_size > 1
    kernels = ("off", "fused") if fused else ("off",)
    out: dict = {f"{kind}{'_fused' * (k == 'fused')}": {} for kind in ("greedy", "sampled") for k in kernels}
    from qlora_fsdp.kernels.fused_decoding import KERNEL_CALLS

    before = dict(KERNEL_CALLS)
    for layout in LAYOUTS if info.world_size > 1 else ("gathered",):
        for kind, kernel in ((kind, kernel) for kind in ("greedy", "sampled") for kernel in kernels):
            grpo = generation_plan(num_generations=2, max_completion_length=GENERATED, temperature=0.9, top_k=50,
                                   top_p=0.95, kernels=kernel)
            torch.manual_seed(7 + info.rank)
            made = generate(model, tokenizer, mine, grpo, info.device, info.world_size, layout, kind == "greedy")
            every_rank: list = [None] * info.world_size
            torch.distributed.all_gather_object(every_rank, made.ids) if info.world_size > 1 else None
            out[f"{kind}{'_fused' * (kernel == 'fused')}"][layout] = [
                ids for ranks in (every_rank if info.world_size > 1 else [made.ids]) for ids in ranks]
    out["kernel_calls"] = {kind: KERNEL_CALLS[kind] - before.get(kind, 0) for kind in ("linear", "attention")}
    return out


def reference_model(model_dir: Path) -> torch.nn.Module:
    """transformers' own NF4 model of the checkpoint's class (a multimodal one stays multimodal); bitsandbytes
    leaves fused experts unquantized, so each expert matrix is rounded through its quantize_4bit/dequantize_4bit."""
    model_class = getattr(transformers, AutoConfig.from_pretrained(model_dir).architectures[0])
    model = transformers_nf4(model_dir, model_class)
    round_experts_through_nf4(model)
    return model


@torch.no_grad()
def round_experts_through_nf4(model: torch.nn.Module) -> int:
    """Every expert matrix of every 3-D experts parameter, rounded as our dense weights are (the test's own code)."""
    import bitsandbytes.functional as bnbf

    rounded = 0
    for name, param in model.named_parameters():
        if param.ndim != 3 or ".experts." not in name:  # Qwen3.5's short convolutions are 3-D too
            continue
        for expert in param:
            packed, state = bnbf.quantize_4bit(expert.contiguous(), blocksize=64, compress_statistics=True,
                                               quant_type="nf4", quant_storage=torch.uint8)
            expert.copy_(bnbf.dequantize_4bit(packed, state))
        rounded += 1
    return rounded


def expected_adapter_keys(base: torch.nn.Module) -> set[str]:
    """What one step must give a gradient to, read off transformers' model rather than our adapter's config: LoRA on
    every decoder linear, and where the family trains them, the experts' LoRA (PEFT nests gate_up_proj's under
    base_layer) and every router parameter."""
    keys = {key for key in decoder_lora_keys(base) if not read_as_experts_by_peft(base, key)}
    if base.config.model_type not in TRAINS_EXPERTS:
        return keys
    for name, module in base.named_modules():
        if name.endswith(".experts") and getattr(module, "gate_up_proj", None) is not None:
            keys |= {f"base_model.model.{name}.{nested}lora_{part}.weight" for nested in ("", "base_layer.")
                     for part in "AB"}
        elif type(module).__name__.endswith(("TopKRouter", "Llama4Router")):
            keys |= {f"base_model.model.{name}.{param}" for param, _ in module.named_parameters()}
    return keys


def read_as_experts_by_peft(base: torch.nn.Module, key: str) -> bool:
    """PEFT moves a target named as a transformers 4 expert projection (DeepSeek-V3's `gate_proj`, whatever module it
    names: a dense MLP's, a shared expert's) onto the fused experts: no adapter can hold LoRA there for the family."""
    from peft.utils import transformers_weight_conversion as conversion

    pattern = conversion._MODEL_TO_CONVERSION_PATTERN.get(base.config.model_type)
    leaf = key.split(".lora_")[0].rsplit(".", 1)[-1]
    return leaf in conversion._MOE_TARGET_MODULE_MAPPING.get(pattern, {})


def reference_side(model_dir: Path, adapter: Path, samples: list[Sample]) -> dict:
    """Held-out loss of transformers + bitsandbytes NF4 (each sample alone), and with PEFT loading our adapter:
    one step's gradients of the same loss and one sample's logits."""
    base = reference_model(model_dir)
    expected_keys = expected_adapter_keys(base)  # before PEFT wraps the modules
    n_targets = sum(sum(label != -100 for label in s.labels[1:]) for s in samples)

    def loss(model) -> torch.Tensor:
        total = torch.zeros(())
        for sample in samples:
            logits = model(input_ids=torch.tensor([sample.input_ids])).logits[0, :-1]
            total = total + torch.nn.functional.cross_entropy(logits.float(), torch.tensor(sample.labels[1:]),
                                                              ignore_index=-100, reduction="sum")
        return total / n_targets

    with torch.no_grad():
        base_loss = loss(base).item()
    peft_model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    loss(peft_model).backward()
    grads = {peft_adapter_key(name, "default"): param.grad for name, param in peft_model.named_parameters()
             if param.requires_grad}
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor([samples[0].input_ids])).logits
        peft_model.eval()
        eos = peft_model.config.get_text_config().eos_token_id
        greedy = [peft_model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                      max_new_tokens=GENERATED, do_sample=False, pad_token_id=0,
                                      eos_token_id=eos)[0, len(prompt):].tolist()
                  for prompt in generation_prompts(samples)]  # the mask: these prompts hold the pad id
    return {"loss": base_loss, "grads": grads, "logits": logits, "expected_keys": expected_keys, "greedy": greedy}


def stored_keys(folder: Path) -> set[str]:
    from qlora_fsdp.loading.weight_files import stored_weight_tensors

    return {key for key, _, _ in stored_weight_tensors(folder, allow_pickle=False)}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def assert_adapter_targets_the_decoder_only(model_dir: Path, adapter: Path) -> None:
    """PEFT matches a string `target_modules` in full against each module name of the multimodal model: it must name
    the decoder's projections and none of the vision tower's (whose q_proj and fc1 a name list would catch too)."""
    from qlora_fsdp.loading.layout import meta_full_model

    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert isinstance(targets, str), f"a list of names also matches the vision tower: {targets}"
    names = [name for name, _ in meta_full_model(AutoConfig.from_pretrained(model_dir)).named_modules()]
    vision = [name for name in names if "vision" in name]
    assert vision and not [name for name in vision if re.fullmatch(targets, name)]
    assert [name for name in names if name.endswith("q_proj") and re.fullmatch(targets, name)]


@pytest.mark.parametrize("family", sorted(FAMILIES | MOE_FAMILIES))
def test_family_equals_transformers_and_peft_at_world_sizes_1_and_2(family, tokenizer, tmp_path):
    model_dir = write_family_model(tmp_path / family, family, tokenizer)
    samples = variable_length_samples(family_config(model_dir, tmp_path / "cfg"), N_SAMPLES)
    assert min(len(s.input_ids) for s in samples) > 16  # longer than every window
    adapter = tmp_path / "adapter"
    one = run_ranks(our_side, 1, model_dir, tmp_path / "one", samples, None, tmp_dir=tmp_path)[0]
    # two ranks with the attention side in 8-token tiles (norms, projections, head norms): every number as before
    two = run_ranks(our_side, 2, model_dir, tmp_path / "two", samples, adapter, 8, tmp_dir=tmp_path)[0]
    if family.endswith("multimodal"):
        assert_adapter_targets_the_decoder_only(model_dir, adapter)
    reference = reference_side(model_dir, adapter, samples)
    print(f"{family}: reference {reference['loss']:.6f}, ours " + ", ".join(
        f"{name} {run[kind]:.6f}" for name, run in (("ws1", one), ("ws2", two)) for kind in ("packed", "padded")))

    assert two["q_runs"] > 3 * one["q_runs"], (one["q_runs"], two["q_runs"])  # the tiles ran
    for run in (one, two):  # held-out loss, packed and alone, equal to transformers + bitsandbytes NF4
        assert run["packed"] == pytest.approx(reference["loss"], rel=1e-4)
        assert run["padded"] == pytest.approx(reference["loss"], rel=1e-4)
        assert run["adapter_off"] == pytest.approx(run["packed"], rel=1e-6)
    assert len(reference["expected_keys"]) >= 16  # 2 layers, at least 4 linears each
    assert reference["grads"].keys() >= reference["expected_keys"]
    for run in (one, two):  # one step's LoRA gradients equal transformers + PEFT's on the same 4-bit model
        assert run["grads"].keys() == reference["grads"].keys()
        for key, grad in reference["grads"].items():
            assert relative(run["grads"][key], grad) < 1e-4, key
    # the adapter loads in PEFT and gives our logits, and the sampler's model holds the same adapter
    assert relative(two["logits"], reference["logits"]) < 1e-4
    assert relative(two["generator_logits"], reference["logits"]) < 1e-4
    assert len(two["reply"]) > 0
    # GRPO's generation: greedy, each layout's completions are transformers' generate of the unsharded 4-bit model
    # with the adapter (each prompt alone); sampled from one seed, the layouts agree with each other
    expected = [ids for ids in reference["greedy"] for _ in range(2)]  # num_generations 2
    for run in (one, two):
        for layout, made in run["greedy"].items():
            assert made == expected, layout
    assert two["sampled"]["gathered"] == two["sampled"]["split"] == two["sampled"]["per_token"]
    if family in FUSED_KERNEL_FAMILIES:  # the fused kernels: the same greedy tokens, the same samples for a seed
        assert two["greedy_fused"] == {layout: expected for layout in two["greedy"]}
        assert two["sampled_fused"] == two["sampled"]
        assert two["kernel_calls"]["linear"] > 0, two["kernel_calls"]  # the kernels ran
        # attention: over the live cache for full attention; Mistral's windowed layers decode as before
        assert (two["kernel_calls"]["attention"] > 0) == (family != "mistral"), two["kernel_calls"]

    # the merge, loaded by transformers as the checkpoint's own class, gives the live logits
    merged_dir = tmp_path / "merged"
    merge_adapter(family_config(model_dir, tmp_path / "cfg"), adapter, merged_dir, "float32")
    assert stored_keys(merged_dir) == stored_keys(model_dir)  # every tensor kept (a vision tower, as it was)
    model_class = getattr(transformers, AutoConfig.from_pretrained(merged_dir).architectures[0])
    attention = "eager" if family == "gemma2" else None  # transformers refuses sdpa for its soft-capping
    merged = model_class.from_pretrained(merged_dir, dtype=torch.float32, attn_implementation=attention)
    with torch.no_grad():
        logits = merged(input_ids=torch.tensor([samples[0].input_ids])).logits
    assert relative(logits, reference["logits"]) < 1e-4


def test_the_run_names_its_kernel_and_what_of_the_familys_attention_it_computes(tokenizer, tmp_path):
    from qlora_fsdp.layers.decoder import describe_attention
    from qlora_fsdp.loading.checkpoint import load_hf_config
    from qlora_fsdp.loading.sharding import sharded_meta_model

    lines = {}
    for family in ("gemma2", "qwen3_5", "llama"):
        cfg = family_config(write_family_model(tmp_path / family, family, tokenizer), tmp_path / "out")
        lines[family] = describe_attention(sharded_meta_model(cfg, load_hf_config(cfg), None, shard=False))
    assert lines["gemma2"] == "attention: sdpa_varlen for gemma2 (sliding windows of 16 tokens, logit soft-capping)"
    assert lines["qwen3_5"] == "attention: sdpa_varlen for qwen3_5_text (recurrent layers one sample at a time)"
    assert lines["llama"] == "attention: sdpa_varlen for llama"


def in_memory_gemma3_key(key: str) -> str:
    """Gemma 3's multimodal checkpoint keys as the model holds them since transformers 4.50 (transformers saves, and
    the hub keeps, the older layout: `language_model.model.`)."""
    moves = (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
             ("multi_modal_projector.", "model.multi_modal_projector."), ("language_model.lm_head.", "lm_head."))
    for old, new in moves:
        if key.startswith(old):
            return new + key.removeprefix(old)
    return key


def test_both_multimodal_layouts_are_read_through_transformers_rules(tokenizer, tmp_path):
    """The stored layout and the model's own map every decoder tensor to the same key of our text model, and the
    vision tower to none; Llama 4's layout, head included, likewise."""
    from qlora_fsdp.loading.build import build_meta_model
    from qlora_fsdp.loading.checkpoint import load_hf_config

    model_dir = write_family_model(tmp_path / "mm", "gemma3_multimodal", tokenizer)
    cfg = family_config(model_dir, tmp_path / "out")
    layout = model_layout(build_meta_model(cfg, load_hf_config(cfg)))
    keys = stored_keys(model_dir)
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in keys
    mapped = {key: layout.model_key(key)[0] for key in keys}
    assert {key: layout.model_key(in_memory_gemma3_key(key))[0] for key in keys} == mapped
    assert all((ours is None) == ("vision_tower" in key or "multi_modal_projector" in key)
               for key, ours in mapped.items())
    assert mapped["language_model.model.layers.0.self_attn.q_proj.weight"] == "model.layers.0.self_attn.q_proj.weight"

    # Llama 4's: the text model's head under `language_model.` too, its decoder's prefix naming no attribute of it
    model_dir = write_family_model(tmp_path / "llama4", "llama4_multimodal", tokenizer)
    cfg = family_config(model_dir, tmp_path / "out")
    layout = model_layout(build_meta_model(cfg, load_hf_config(cfg)))
    mapped = {key: layout.model_key(key)[0] for key in stored_keys(model_dir)}
    assert all((ours is None) == key.startswith(("vision_model.", "multi_modal_projector."))
               for key, ours in mapped.items())
    assert mapped["language_model.lm_head.weight"] == "lm_head.weight"
    assert mapped["language_model.model.layers.1.feed_forward.experts.gate_up_proj"] == \
        "model.layers.1.feed_forward.experts.gate_up_proj"
    assert layout.full_from_ours("lm_head.weight") == "language_model.lm_head.weight"


def plain_copy(model_dir: Path, out: Path, **loading) -> Path:
    """The checkpoint as transformers holds it in memory, saved as is: experts fused (the layout gpt-oss ships),
    MXFP4 experts decoded by transformers (`loading`: its quantization_config), no quantization_config."""
    import json
    import shutil

    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, **loading)
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({key: value.contiguous() for key, value in model.state_dict().items() if key != "lm_head.weight"
               or not model.config.tie_word_embeddings}, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def experts_side(info, pairs: list[tuple[Path, Path]], out: Path) -> dict:
    """Each rank's expert rows from both checkpoints of each pair, and what the last model says of itself."""
    from qlora_fsdp.layers.experts4bit import Experts4bit
    from qlora_fsdp.loading.build import base_parameter_count

    rows = []
    for pair in pairs:
        for model_dir in pair:
            model = build_sharded_model(family_config(model_dir, out), info)
            rows.append({name: param.to_local().clone() for name, param in model.named_parameters()
                         if name.endswith(("gate_up_proj", "down_proj"))})
    modules = [m for m in model.modules() if isinstance(m, Experts4bit)]
    return {"rows": rows, "dtypes": {r.dtype for r in rows[0].values()}, "n_modules": len(modules),
            "base_parameters": base_parameter_count(model)}


def test_experts_load_the_same_4bit_bytes_from_every_checkpoint_form(tokenizer, tmp_path):
    """Qwen3-MoE as the hub ships it (one tensor an expert) and fused, gpt-oss in MXFP4 (as OpenAI ships it) and
    decoded by transformers: each rank holds the same bytes for its experts either way; the merge of the MXFP4
    checkpoint writes the decoded experts; PEFT's LoRA on the fused experts is refused in one line, and so is
    lora.target_experts with dropout (PEFT could not load it)."""
    from transformers import Mxfp4Config

    from qlora_fsdp.errors import ConfigError
    from qlora_fsdp.loading.build import build_meta_model
    from qlora_fsdp.loading.checkpoint import load_hf_config
    from tests.families import write_mxfp4_copy

    per_expert = write_family_model(tmp_path / "qwen3_moe", "qwen3_moe", tokenizer)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in stored_keys(per_expert)
    fused = plain_copy(per_expert, tmp_path / "fused")
    assert "model.layers.0.mlp.experts.gate_up_proj" in stored_keys(fused)
    mxfp4 = write_mxfp4_copy(write_family_model(tmp_path / "gpt_oss", "gpt_oss", tokenizer), tmp_path / "mxfp4")
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in stored_keys(mxfp4)
    decoded = plain_copy(mxfp4, tmp_path / "decoded", quantization_config=Mxfp4Config(dequantize=True))
    ranks = run_ranks(experts_side, 2, [(per_expert, fused), (mxfp4, decoded)], tmp_path / "out", tmp_dir=tmp_path)
    for rank in ranks:
        for one, other in (rank["rows"][0:2], rank["rows"][2:4]):
            assert one.keys() == other.keys() and len(one) == 4  # 2 layers x (gate_up_proj, down_proj)
            for name, row in one.items():
                assert row.shape[0] == 2 and torch.equal(row, other[name]), name  # 2 of the 4 experts a rank
    assert ranks[0]["dtypes"] == {torch.uint8} and ranks[0]["n_modules"] == 2
    reference = transformers.AutoModelForCausalLM.from_pretrained(decoded)
    assert ranks[0]["base_parameters"] == sum(p.numel() for p in reference.parameters())  # experts at full size

    adapter = tmp_path / "peft_adapter"  # PEFT's own, on the decoded model: the merge reads any PEFT adapter
    peft.get_peft_model(reference, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
                        ).save_pretrained(adapter)
    merged = {}
    for name, model_dir in (("mxfp4", mxfp4), ("decoded", decoded)):
        merge_adapter(family_config(model_dir, tmp_path / "out"), adapter, tmp_path / f"merged_{name}", "float32")
        merged[name] = load_file_tensors(tmp_path / f"merged_{name}")
    assert merged["mxfp4"].keys() == merged["decoded"].keys()
    assert "model.layers.0.mlp.experts.down_proj" in merged["mxfp4"]  # decoded, under the parameter's own name
    assert all(torch.equal(value, merged["decoded"][key]) for key, value in merged["mxfp4"].items())

    cfg = family_config(per_expert, tmp_path / "out")
    cfg.lora.target_modules = ["q_proj", "gate_proj", "up_proj"]  # transformers 4 names of the expert projections
    with pytest.raises(ConfigError, match="puts PEFT's LoRA on the experts") as err:
        build_meta_model(cfg, load_hf_config(cfg))
    assert "\n" not in str(err.value)
    cfg.lora.target_modules, cfg.lora.target_experts, cfg.lora.dropout = "all-linear", True, 0.1
    with pytest.raises(ConfigError, match="PEFT's LoRA on experts has no dropout"):  # PEFT could not load it
        build_meta_model(cfg, load_hf_config(cfg))


def load_file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def router_loss_side(info, model_dir: Path, out: Path, samples: list[Sample]) -> dict:
    from qlora_fsdp.objectives.supervised import accumulate_gradients

    cfg = family_config(model_dir, out)
    model = build_sharded_model(cfg, info)
    result = accumulate_gradients(model, [collate(samples, 0)], info.device, ForwardLoss.for_config(cfg, info.device))
    # in bf16, as on a GPU: the trained routers (fp32, lora.dtype) take the bf16 hidden states and train
    cfg.model.dtype = cfg.quant.compute_dtype = "bfloat16"
    bf16 = build_sharded_model(cfg, info)
    accumulate_gradients(bf16, [collate(samples[:1], 0)], info.device, ForwardLoss.for_config(cfg, info.device))
    router_grads = [param.grad for name, param in bf16.named_parameters() if name.endswith("mlp.gate.weight")]
    return {"loss": result.loss, "aux": result.metrics.get("router_aux_loss"), "bf16_router_grads": router_grads}


def test_the_load_balancing_loss_is_added_as_transformers_adds_it(tokenizer, tmp_path):
    """A Qwen3-MoE whose config asks for it (output_router_logits): one training micro-batch's loss is transformers'
    (mean cross-entropy + router_aux_loss_coef x the load-balancing loss, pads masked), and the step reports it."""
    model_dir = write_family_model(tmp_path / "qwen3_moe", "qwen3_moe", tokenizer)
    config = AutoConfig.from_pretrained(model_dir)
    config.output_router_logits, config.router_aux_loss_coef = True, 0.3
    config.save_pretrained(model_dir)
    samples = variable_length_samples(family_config(model_dir, tmp_path / "cfg"), 4)
    ours = run_ranks(router_loss_side, 1, model_dir, tmp_path / "out", samples, tmp_dir=tmp_path)[0]
    reference = reference_model(model_dir)
    batch = collate(samples, 0)
    labels = torch.full_like(batch.input_ids, -100)
    for row, sample in enumerate(samples):
        labels[row, : len(sample.labels)] = torch.tensor(sample.labels)
    with torch.no_grad():
        expected = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels)
    assert expected.aux_loss is not None and float(expected.aux_loss) > 0.5  # about 1 when routing is balanced
    assert ours["aux"] == pytest.approx(float(expected.aux_loss), rel=1e-5)
    assert ours["loss"] == pytest.approx(float(expected.loss), rel=1e-4)
    grads = ours["bf16_router_grads"]
    assert len(grads) == 2 and all(g.dtype == torch.float32 and 0 < g.norm() < float("inf") for g in grads)


def trained_and_resumed(info, cfg, root: Path) -> None:
    """3 steps straight (a checkpoint each step), and a resume of its step 2 to step 3 in another folder."""
    import dataclasses

    from qlora_fsdp.api import train

    for name, resume in (("straight", "never"), ("resumed", str(root / "straight" / "checkpoints" / "step-000002"))):
        train_cfg = dataclasses.replace(cfg.train, max_steps=3, output_dir=str(root / name), resume=resume,
                                        save_every=1, keep_last=3, eval_every=0)
        train(dataclasses.replace(cfg, train=train_cfg), info=info)


def sampled_alone(info, adapter: Path, input_ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    from qlora_fsdp.loading.adapter import config_for_adapter

    generator = load_generator(config_for_adapter(adapter, None, []), adapter)
    with torch.no_grad():
        logits = generator.model(input_ids=input_ids).logits.cpu()
    return generator.token_ids("Name a colour.", Sampling(max_new_tokens=6)), logits


def step_losses(run_dir: Path) -> dict[int, float]:
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}


def test_a_mixture_of_experts_resumes_bit_identically_and_samples_in_one_process(tokenizer, tmp_path):
    """Qwen3-MoE trained 3 steps on 2 ranks, and resumed from its step-2 checkpoint: the same step-3 loss and adapter,
    bit for bit. The adapter samples in one process with the logits of transformers + PEFT on the 4-bit model."""
    from safetensors.torch import load_file

    model_dir = write_family_model(tmp_path / "qwen3_moe", "qwen3_moe", tokenizer)
    cfg = family_config(model_dir, tmp_path / "unused")
    cfg.data.micro_batch_size, cfg.data.grad_accum_steps = 2, 2
    run_ranks(trained_and_resumed, 2, cfg, tmp_path / "runs", tmp_dir=tmp_path)
    straight, resumed = tmp_path / "runs" / "straight", tmp_path / "runs" / "resumed"
    assert sorted(step_losses(resumed)) == [3] and sorted(step_losses(straight)) == [1, 2, 3]  # step 3 alone
    assert step_losses(resumed)[3] == step_losses(straight)[3]
    ours, theirs = (load_file(run / "adapter" / "adapter_model.safetensors") for run in (resumed, straight))
    assert ours.keys() == theirs.keys() and len(ours) > 0 and all(torch.equal(ours[key], theirs[key]) for key in ours)

    ids = torch.tensor([tokenizer("Name a colour.")["input_ids"]])
    reply, logits = run_ranks(sampled_alone, 1, straight / "adapter", ids, tmp_dir=tmp_path)[0]
    assert len(reply) > 0
    peft_model = PeftModel.from_pretrained(reference_model(model_dir), straight / "adapter")
    with torch.no_grad():
        assert relative(logits, peft_model(input_ids=ids).logits) < 1e-4
