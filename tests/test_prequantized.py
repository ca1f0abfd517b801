"""Pre-quantized bitsandbytes 4-bit checkpoints (the hub's `*-bnb-4bit` repos), trained from as stored.

Each checkpoint here is made as such repos are: transformers + bitsandbytes load a model in NF4 (double
quantization, from bf16) and `save_pretrained` it. Two of them: SmolLM2-135M's first 6 layers (real weights, uint8
storage, one file; tests/conftest.py: `short_real_model_dir`) and a tiny tied Qwen3 (bf16 storage, sharded with an
index). For each, in one pool task per world size: the held-out loss before training equals transformers' own model
loaded from that same checkpoint (its 4-bit values are fixed, so relative 1e-5 in fp32), at world sizes 1 and 2; two
steps lower it; the adapter, loaded by PEFT onto transformers' pre-quantized model, gives our logits; the merge
dequantizes the stored weights and gives them too.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from qlora_fsdp.api import train
from qlora_fsdp.config import Config
from qlora_fsdp.config.loader import to_yaml
from qlora_fsdp.data.batching import Sample, collate
from qlora_fsdp.loading.adapter import adapter_file_key, export_adapter, peft_adapter_key
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.loading.fill import model_layout
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.measure.held import meta_held
from qlora_fsdp.measure.planning import Planning
from qlora_fsdp.tools.adapter_merge import merge_adapter
from qlora_fsdp.tools.adapter_sampling import load_generator
from qlora_fsdp.tools.tiny_model import train_tokenizer
from tests.families import write_family_model
from tests.helpers import (
    REPO,
    decoder_lora_keys,
    full_grads,
    reference_loss,
    run_ranks,
    run_ranks_sequence,
    tiny_config,
    variable_length_samples,
)
from tests.test_families import nonzero_lora_b
from tests.test_real_model import eval_samples, held_out_loss

pytestmark = pytest.mark.slow  # ranks on gloo

IDS = torch.tensor([[1, 17, 42, 99, 7, 230, 5, 64, 12, 300]])


def prequantize(source: Path, out: Path, storage: torch.dtype, max_shard_size: str = "5GB") -> Path:
    """What a `*-bnb-4bit` repo holds: transformers + bitsandbytes' NF4 model, saved (from bf16, as people do)."""
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=storage)
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=quant, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def transformers_prequantized(model_dir: Path, model_class: type = AutoModelForCausalLM) -> torch.nn.Module:
    """transformers' own load of the pre-quantized checkpoint, fp32 around the stored 4-bit values."""
    model = model_class.from_pretrained(model_dir, dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False  # the portable kernel, as training's (helpers.transformers_nf4)
    for param in model.parameters():  # transformers keeps a pre-quantized checkpoint's other tensors as stored
        if not isinstance(param, bnb.nn.Params4bit):
            param.data = param.data.float()  # bf16 values exactly, computed in fp32 as ours (model.dtype float32)
    return model.eval()


def transformers_loss(model: torch.nn.Module, cfg: Config) -> float:
    with torch.no_grad():
        total, n_targets = reference_loss(model, eval_samples(cfg))
    return total.item() / n_targets


def live_logits(info, cfg: Config, adapter: Path) -> torch.Tensor:
    """The adapter's logits as generate.py holds the model (our loading of the pre-quantized checkpoint)."""
    with torch.no_grad():
        return load_generator(cfg, adapter).model(input_ids=IDS.to(info.device)).logits.cpu()


def trained(info, cfg: Config) -> dict:
    return train(cfg, info=info)


def gradients(info, cfg: Config, samples: list[Sample], adapter: Path) -> dict:
    """One step's LoRA gradients with B nonzero (saved as an adapter for PEFT to load), samples split over ranks."""
    model = build_sharded_model(cfg, info)
    nonzero_lora_b(model)
    n_targets = sum(sum(label != -100 for label in s.labels[1:]) for s in samples)
    batch = collate(samples[info.rank :: info.world_size], 0)
    (ForwardLoss.for_config(cfg, info.device)(model, batch, info.device) / n_targets).backward()
    export_adapter(model, load_tokenizer(cfg), adapter, cfg.model.path, info.is_main, to_yaml(cfg))
    return {adapter_file_key(name, model_layout(model)): grad for name, grad in full_grads(model).items()}


def peft_gradients(model_dir: Path, adapter: Path, samples: list[Sample]) -> dict:
    """The same loss through PEFT on transformers' own load of the checkpoint (the samples in one padded batch)."""
    base = transformers_prequantized(model_dir)
    for module in base.modules():
        if isinstance(module, bnb.nn.Linear4bit):  # dequantized to fp32 as ours (model.dtype); stored: bf16
            module.weight.quant_state.dtype = torch.float32
    model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    loss, n_targets = reference_loss(model, samples)  # the samples padded into one batch, the padding masked
    (loss / n_targets).backward()
    return {peft_adapter_key(name, "default"): param.grad for name, param in model.named_parameters()
            if param.requires_grad}


def runs(model_dir: Path, root: Path) -> dict:
    """Two steps at world size 1 (then the adapter's logits) and at world size 2."""
    def config(name: str) -> Config:
        return tiny_config(model_dir, optim={"lr": 1e-3, "warmup_steps": 0},
                           data={"context_length": 128, "packing": False, "micro_batch_size": 2},
                           train={"max_steps": 2, "output_dir": str(root / name)})

    one, two = config("one"), config("two")
    summary, logits = run_ranks_sequence([(trained, (one,)), (live_logits, (one, root / "one" / "adapter"))], 1,
                                         root / "ws1")
    samples = variable_length_samples(one, 4)
    summary_two, grads = run_ranks_sequence([(trained, (two,)), (gradients, (two, samples, root / "grads"))], 2,
                                            root / "ws2")
    return {"cfg": one, "adapter": root / "one" / "adapter", "summaries": (summary, summary_two), "logits": logits,
            "samples": samples, "grads": grads, "grads_adapter": root / "grads"}


@pytest.fixture(scope="module")
def tiny_prequantized(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny_prequantized")
    tokenizer = train_tokenizer(REPO / "data" / "tiny_instruct.jsonl", 512)
    source = write_family_model(root / "source", "qwen3", tokenizer)  # tied head, bf16 as the hub ships
    return prequantize(source, root / "bnb-4bit", torch.bfloat16, max_shard_size="100KB")


@pytest.fixture(scope="module")
def smollm2_prequantized(short_real_model_dir, tmp_path_factory) -> Path:
    return prequantize(short_real_model_dir, tmp_path_factory.mktemp("smollm2") / "bnb-4bit", torch.uint8)


def check_against_transformers(model_dir: Path, result: dict, tmp_path: Path, name: str) -> None:
    cfg, (one, two) = result["cfg"], result["summaries"]
    reference_model = transformers_prequantized(model_dir)
    expected_keys = decoder_lora_keys(reference_model)  # before PEFT wraps the modules
    reference = transformers_loss(reference_model, cfg)
    print(f"{name}: transformers {reference:.6f}, ours ws1 {one['eval_loss_start']:.6f}, "
          f"ws2 {two['eval_loss_start']:.6f}; after 2 steps {one['eval_loss_end']:.6f}, "
          f"{two['eval_loss_end']:.6f}")  # shown by pytest -s
    assert one["eval_loss_start"] == pytest.approx(reference, rel=1e-5)
    assert two["eval_loss_start"] == pytest.approx(reference, rel=1e-5)
    assert one["eval_loss_end"] < one["eval_loss_start"] and two["eval_loss_end"] < two["eval_loss_start"]

    live = result["logits"]
    with torch.no_grad():
        base = reference_model(input_ids=IDS).logits
        peft = PeftModel.from_pretrained(reference_model, result["adapter"]).eval()(input_ids=IDS).logits
    scale = live.abs().max()
    assert (peft - live).abs().max() < 1e-4 * scale
    assert (base - live).abs().max() > 100 * (peft - live).abs().max()  # the adapter matters here

    reference_grads = peft_gradients(model_dir, result["grads_adapter"], result["samples"])
    assert len(expected_keys) >= 2 * 7 * 2 and reference_grads.keys() >= expected_keys  # 2+ layers of 7 linears
    assert result["grads"].keys() == reference_grads.keys()
    for key, grad in reference_grads.items():  # training's path (with gradients) through the stored 4-bit values
        assert (result["grads"][key] - grad).norm() < 1e-4 * grad.norm(), key

    merge_adapter(cfg, result["adapter"], tmp_path / "merged", "float32")
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert (merged(input_ids=IDS).logits - live).abs().max() < 1e-4 * scale


def test_tiny_tied_prequantized_trains_at_world_sizes_1_and_2_equal_to_transformers(tiny_prequantized, tmp_path):
    assert (tiny_prequantized / "model.safetensors.index.json").is_file()  # sharded, bf16 storage
    check_against_transformers(tiny_prequantized, runs(tiny_prequantized, tmp_path / "runs"), tmp_path, "tiny qwen3")


def test_smollm2_prequantized_trains_at_world_sizes_1_and_2_equal_to_transformers(smollm2_prequantized, tmp_path):
    check_against_transformers(smollm2_prequantized, runs(smollm2_prequantized, tmp_path / "runs"), tmp_path,
                               "SmolLM2-135M")


def planned_held(info, cfg: Config) -> dict:
    return dataclasses.asdict(meta_held(Planning.of(cfg), info.mesh))


def test_the_planner_reads_a_prequantized_checkpoint_as_its_original(tiny_prequantized, tmp_path):
    """The same 4-bit layers (and bytes) planned from the pre-quantized folder as from the model it came from."""
    source = tiny_prequantized.parent / "source"
    planned = [run_ranks(planned_held, 2, tiny_config(path), tmp_dir=tmp_path / path.name, fake=True)[0]
               for path in (tiny_prequantized, source)]
    stored, original = planned
    assert stored.pop("largest_packed") == original.pop("largest_linear") // 2 > 0  # loading copies packed bytes
    assert stored.pop("largest_linear") == 0 and original.pop("largest_packed") == 0
    assert stored == original and stored["base_4bit"] > 0
    # a 70B pre-quantized repo plans from its shipped config.json (quantization_config included), not refused
    cfg = tiny_config(tiny_prequantized)
    cfg.model.path = "unsloth/Meta-Llama-3.1-70B-bnb-4bit"
    assert Planning.of(cfg).hf_config.quantization_config["quant_method"] == "bitsandbytes"


def test_a_prequantized_multimodal_gemma3_trains_its_text_model_equal_to_transformers(tmp_path):
    """Gemma 3 4B-27B `-bnb-4bit` repos: the decoder under `language_model.`, its vision tower quantized too."""
    from transformers import Gemma3ForConditionalGeneration

    tokenizer = train_tokenizer(REPO / "data" / "tiny_instruct.jsonl", 512)
    source = write_family_model(tmp_path / "source", "gemma3_multimodal", tokenizer)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)
    model = Gemma3ForConditionalGeneration.from_pretrained(source, quantization_config=quant, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bnb-4bit")
    tokenizer.save_pretrained(tmp_path / "bnb-4bit")
    cfg = tiny_config(tmp_path / "bnb-4bit")
    ours = [run_ranks_sequence([(held_out_loss, (cfg,))], ws, tmp_path / f"ws{ws}")[0] for ws in (1, 2)]
    reference = transformers_loss(transformers_prequantized(tmp_path / "bnb-4bit", Gemma3ForConditionalGeneration),
                                  cfg)
    assert ours == pytest.approx([reference, reference], rel=1e-5)
