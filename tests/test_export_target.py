"""export.target: training through the GGUF llama.cpp will run.

- every type's rounding equals llama.cpp's own quantizer (its libggml-base) value for value on real SmolLM2 weights;
- the straight-through backward gives LoRA's gradients (the rounded weight for the input's);
- end to end, on a tiny llama with rows of 256 and 512 (so q4_K, q5_K and q6_K apply, not only their fallbacks):
  the held-out loss our model computes with export.target at world sizes 1 and 2 equals transformers' on the GGUF
  that qlora-export writes from the same adapter and llama-quantize quantizes (read back by transformers), for each
  target; and each tensor's type in those files is the one training chose (qlora_fsdp/gguf_target/tensor_types.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qlora_fsdp.gguf_target.quantizers import TYPES, rounded
from qlora_fsdp.gguf_target.tensor_types import ModelShape, tensor_type
from qlora_fsdp.gguf_target.through_export import ThroughExport, exported_weight
from qlora_fsdp.kernels.export_rounding import export_rounded
from tests.ggml_quants import libggml, llama_cpp_rounded

TARGETS = ("q4_k_m", "q5_k_m", "q4_0", "q8_0")
# (key, rows): real SmolLM2 weights; the down projection's rows 448-575 hold a block whose scale lands on a tie of
# q4_K's 6-bit rounding (59.5: an implementation that divides differently picks 59, llama.cpp 60)
REAL_TENSORS = (("model.layers.0.mlp.down_proj.weight", slice(448, 576)),
                ("model.layers.11.self_attn.v_proj.weight", slice(0, 64)),
                ("model.layers.29.mlp.gate_proj.weight", slice(0, 64)),
                ("model.embed_tokens.weight", slice(1000, 1128)))


def needs_libggml() -> None:
    if libggml() is None:
        pytest.skip("no libggml-base (make llama-quantize)")


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_each_type_is_llama_cpps_rounding_on_real_weights(real_model_dir, monkeypatch):
    """Whole, and in chunks of 3 rows (the last one shorter): what a large weight is rounded in."""
    from safetensors import safe_open

    from qlora_fsdp.gguf_target import quantizers

    needs_libggml()
    tensors = {}
    for file in sorted(real_model_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as stored:
            tensors |= {key: stored.get_tensor(key) for key, _ in REAL_TENSORS if key in stored.keys()}
    for key, rows in REAL_TENSORS:
        weight = tensors[key][rows].to(torch.float16).float()  # the converter's f16 file, as llama-quantize reads it
        for ggml_type in TYPES:
            w = weight[:, : weight.shape[1] // 256 * 256] if ggml_type.endswith("_K") else weight
            expected = llama_cpp_rounded(w, ggml_type)
            assert torch.equal(rounded(w, ggml_type), expected), (key, ggml_type)
            monkeypatch.setattr(quantizers, "CHUNK_ELEMENTS", 3 * w.shape[1] + 1)
            assert w.shape[0] % 3 and torch.equal(rounded(w, ggml_type), expected), (key, ggml_type, "chunks")
            monkeypatch.undo()
            kernel_out = torch.empty_like(w)  # the GPU's one kernel (interpreted here), from the searched steps
            export_rounded(kernel_out, w, None, 1.0, ggml_type, list(quantizers.block_steps(w, ggml_type) or ()))
            assert torch.equal(kernel_out, expected), (key, ggml_type, "kernel")


def test_the_rounding_kernel_is_the_torch_rounding(monkeypatch):
    """kernels/export_rounding.py (under TRITON_INTERPRET=1) against quantizers.py, value for value: every type, the
    merge formed in the kernel (bf16 base + s B A) or given, float32 and bfloat16 weights out, blocks of zeros, of
    a magnitude tied between signs and of exact halves; the k-quants' block search kernel's stored steps; through
    exported_weight with a cache and in chunks."""
    from qlora_fsdp.gguf_target import quantizers, through_export
    from qlora_fsdp.gguf_target.through_export import SearchCache
    from qlora_fsdp.kernels.export_rounding import export_searched

    torch.manual_seed(3)
    base = (0.02 * torch.randn(24, 512)).bfloat16()
    base[0, :32] = 0  # a block of zeros
    base[1, :32], base[1, 5], base[1, 9] = 0.01, -0.03, 0.03  # the signed absmax's first of a tie
    base[2, :32] = torch.cat([torch.arange(31) + 0.5, torch.tensor([127.0])]) / 1024  # q8_0: x / d is k + 0.5
    a, b, scale = 0.05 * torch.randn(4, 512), 0.05 * torch.randn(24, 4), 2.0
    b[:3] = 0  # those rows as built
    product = b @ a
    merged = (base.float() + scale * product).half().float()
    for ggml_type in TYPES:
        steps = quantizers.block_steps(merged, ggml_type)
        expected = rounded(merged, ggml_type, steps)
        if steps is not None:  # the block search's kernel: the same stored steps
            searched = quantizers.empty_steps(merged, ggml_type)
            export_searched(list(searched), merged, quantizers.candidate_numerators(ggml_type), ggml_type)
            assert all(torch.equal(ours, theirs) for ours, theirs in zip(searched, steps, strict=True)), ggml_type
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(base.shape, dtype=dtype)
            export_rounded(out, base, product, scale, ggml_type, list(steps or ()))
            assert torch.equal(out, expected.to(dtype)), (ggml_type, dtype)
        monkeypatch.setattr(quantizers, "CHUNK_ELEMENTS", 5 * 512)  # 5 chunks, the last of 4 rows
        # a run's search in its kernel, as on a GPU (the tests' runs search in torch: the interpreter is slow)
        in_kernel = ggml_type == "q6_K"  # its kernel the quickest interpreted
        monkeypatch.setattr(through_export, "search_in_kernel", lambda: in_kernel)  # noqa: B023 (undone below)
        cache = SearchCache()
        for _ in range(2):  # searched, then from the cache
            fused = exported_weight(base, ggml_type, (a, b, scale), cache, torch.bfloat16, fused=True)
            assert torch.equal(fused, expected.to(torch.bfloat16)), (ggml_type, "exported_weight")
        monkeypatch.undo()


def test_the_backward_is_loras_through_the_rounded_weight(monkeypatch):
    """Forward: x times the rounded merged weight, exactly (made a chunk of rows at a time, equal to the whole
    merge rounded). Backward: the input's gradient through that weight, A's and B's as a LoRA over the frozen base
    (rounded weight - s B A) gets them."""
    from qlora_fsdp.gguf_target import quantizers

    torch.manual_seed(0)
    x = torch.randn(3, 5, 256, requires_grad=True)
    a, b = (0.05 * torch.randn(4, 256)).requires_grad_(), (0.05 * torch.randn(64, 4)).requires_grad_()
    base, scale = 0.02 * torch.randn(64, 256), 2.0
    out = ThroughExport.apply(x, a, b, base, None, scale, "q4_K")
    weight = exported_weight(base, "q4_K", (a, b, scale))
    assert torch.equal(out, F.linear(x, weight))
    assert torch.equal(weight, rounded((base + scale * (b @ a)).detach().half().float(), "q4_K"))
    monkeypatch.setattr(quantizers, "CHUNK_ELEMENTS", 5 * 256)  # 13 chunks, the last of 4 rows
    assert torch.equal(exported_weight(base, "q4_K", (a, b, scale)), weight)
    monkeypatch.undo()
    assert not torch.equal(weight, (base + scale * (b @ a)).detach())  # the rounding did something
    grad = torch.randn_like(out)
    out.backward(grad)
    x2, a2, b2 = (t.detach().clone().requires_grad_() for t in (x, a, b))
    frozen = (weight - scale * (b2 @ a2)).detach()
    (F.linear(x2, frozen) + scale * F.linear(F.linear(x2, a2), b2)).backward(grad)
    for ours, lora in ((x.grad, x2.grad), (a.grad, a2.grad), (b.grad, b2.grad)):
        assert relative(ours, lora) < 1e-5


def test_the_block_search_is_made_again_once_the_adapter_changes():
    """The micro-batches of one optimizer step reuse a linear's k-quant block search; an update of A or B (in place,
    as the optimizer makes it) searches again, so the forward is the uncached rounding of the new merged weight."""
    from qlora_fsdp.gguf_target.through_export import SearchCache

    torch.manual_seed(1)
    x, base, scale = torch.randn(4, 512), 0.02 * torch.randn(32, 512), 2.0
    a, b = 0.05 * torch.randn(4, 512), 0.05 * torch.randn(32, 4)
    cache = SearchCache()
    for _ in range(2):  # the second call is served by the cache
        out = ThroughExport.apply(x, a, b, base, None, scale, "q4_K", cache)
        assert torch.equal(out, F.linear(x, exported_weight(base, "q4_K", (a, b, scale))))
    with torch.no_grad():
        b.add_(0.05 * torch.randn_like(b))
    out = ThroughExport.apply(x, a, b, base, None, scale, "q4_K", cache)
    assert torch.equal(out, F.linear(x, exported_weight(base, "q4_K", (a, b, scale))))


def tiny_wide_llama(out: Path, tokenizer) -> Path:
    """4 layers (llama.cpp's more-bits layers 2 and 3), rows of 256 and 512, an untied head; a sentencepiece
    tokenizer llama.cpp's converter knows (tests/conftest.py's sp_tokenizer)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.copy(Path(tokenizer.name_or_path) / "tokenizer.model", out)  # what the converter reads the vocabulary from
    return out


def export_config(model_dir: Path, out: Path, target: str):
    from tests.helpers import tiny_config

    return tiny_config(model_dir, train={"output_dir": str(out)}, lora={"r": 4, "dropout": 0.0},
                       export={"target": target})


def through_export_side(info, model_dir: Path, out: Path, samples: list, adapter: Path | None) -> dict:
    """Each target's held-out loss of the same adapter (B seeded by name, so every world size and target holds the
    same one), and for q4_k_m: the loss with the shards offloaded to host memory, and one training step's LoRA
    gradients (training's loss, every layer checkpointed); the adapter saved once, from the q4_k_m run."""
    from qlora_fsdp.config.loader import to_yaml
    from qlora_fsdp.data.batching import collate
    from qlora_fsdp.distributed import all_reduce_sums
    from qlora_fsdp.loading.adapter import export_adapter
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.losses.forward import ForwardLoss
    from tests.helpers import full_grads
    from tests.test_families import nonzero_lora_b, summed

    n_targets = sum(sum(label != -100 for label in s.labels[1:]) for s in samples)
    mine = collate(samples[info.rank :: info.world_size], 0)
    result: dict = {}
    for target in (*TARGETS, "none", "offloaded"):
        cfg = export_config(model_dir, out / target, "q4_k_m" if target == "offloaded" else target)
        cfg.fsdp.cpu_offload = target == "offloaded"
        model = build_sharded_model(cfg, info)
        nonzero_lora_b(model)
        (loss,) = all_reduce_sums([summed(model, mine, info)], info.device)
        result[target] = loss / n_targets
        if target != "q4_k_m":
            continue
        assert cfg.activation_checkpointing.mode == "every_layer"
        (ForwardLoss.for_config(cfg, info.device)(model, mine, info.device) / n_targets).backward()
        result["grads"] = full_grads(model)
        if adapter is not None:  # its training_config.yaml names the target
            export_adapter(model, load_tokenizer(cfg), adapter, str(model_dir), info.is_main, to_yaml(cfg))
    return result


def gguf_files(adapter: Path, work: Path) -> dict[str, Path]:
    """qlora-export's files of the adapter for every target: its q4_k_m (the run's export.target, the default type)
    keeping the merge and the f16 file, which llama.cpp quantizes to the others; q8_0 written by the converter itself,
    as qlora-export writes it."""
    from qlora_fsdp.commands.export import main as export_main
    from qlora_fsdp.tools.llama_quantize import find_quantizer, quantize

    # no --outtype: the run's export.target, q4_k_m
    assert export_main(["--adapter", str(adapter), "--out", str(work / "q4"), "--name", "m", "--keep-merged",
                        "--keep-f16"]) == 0
    files = {"q4_k_m": work / "q4" / "m-Q4_K_M.gguf"}
    quantizer = find_quantizer()
    assert quantizer is not None
    for target in ("q5_k_m", "q4_0"):
        files[target] = work / f"m-{target}.gguf"
        quantize(quantizer, work / "q4" / "m-F16.gguf", files[target], target)
    assert export_main(["--model", str(work / "q4" / "merged"), "--out", str(work / "q8"), "--name", "m",
                        "--outtype", "q8_0"]) == 0
    files["q8_0"] = work / "q8" / "m-Q8_0.gguf"
    return files


GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


def our_name(gguf_name: str) -> str | None:
    """model.layers.1.self_attn.v_proj for blk.1.attn_v.weight; None for a norm."""
    if gguf_name in ("token_embd.weight", "output.weight"):
        return {"token_embd.weight": "model.embed_tokens", "output.weight": "lm_head"}[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or parts[2] not in GGUF_NAMES:
        return None
    return f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}"


def gguf_types(file: Path) -> dict[str, tuple[str, int]]:
    """Each weight's type in the file, and its row length, by our module name."""
    from gguf import GGUFReader

    found = {}
    for tensor in GGUFReader(file).tensors:
        name = our_name(tensor.name)
        if name is not None:
            found[name] = (tensor.tensor_type.name, int(tensor.shape[0]))
    return found


def transformers_loss(file: Path, samples: list) -> float:
    """transformers' held-out loss on the GGUF file (its weights as llama.cpp stores them, read back)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    n_targets = sum(sum(label != -100 for label in s.labels[1:]) for s in samples)
    total = 0.0
    with torch.no_grad():
        for sample in samples:
            logits = model(input_ids=torch.tensor([sample.input_ids])).logits[0, :-1]
            total += float(F.cross_entropy(logits, torch.tensor(sample.labels[1:]), ignore_index=-100,
                                           reduction="sum"))
    return total / n_targets


def lora_gguf_runs_as_its_merge(adapter: Path, model_dir: Path, work: Path) -> None:
    """qlora-export --lora-only: llama.cpp running the original base's f32 GGUF with the LoRA GGUF gives the logits
    of the adapter merged into that base (f32); over the base's q4_k_m it loads, runs and moves the logits toward the
    merge; the Modelfile is FROM the base, with the file as its ADAPTER."""
    from qlora_fsdp.commands.export import main as export_main
    from qlora_fsdp.tools.llama_quantize import find_quantizer, quantize
    from tests.test_gguf_export import run_in_llama_cpp

    quantizer = find_quantizer()
    assert quantizer is not None
    assert export_main(["--model", str(model_dir), "--out", str(work / "base"), "--name", "b", "--outtype", "f32"]) == 0
    assert export_main(["--adapter", str(adapter), "--out", str(work / "merged"), "--name", "m", "--outtype", "f32",
                        "--base-weights", "original"]) == 0
    base = work / "base" / "b-F32.gguf"
    quantize(quantizer, base, work / "b-Q4_K_M.gguf", "q4_k_m")
    assert export_main(["--adapter", str(adapter), "--out", str(work / "lora"), "--name", "m", "--lora-only",
                        "--base-gguf", str(work / "b-Q4_K_M.gguf")]) == 0
    lora = work / "lora" / "m-lora-F32.gguf"
    assert (work / "lora" / "Modelfile").read_text().startswith(
        f"FROM {(work / 'b-Q4_K_M.gguf').resolve()}\nADAPTER ./m-lora-F32.gguf\n")
    prompt = "the quick brown fox"

    def logits(gguf: Path, with_lora: Path | None = None) -> torch.Tensor:
        return torch.tensor(run_in_llama_cpp(quantizer, gguf, prompt, with_lora)["logits"])

    merged, plain, with_adapter = logits(work / "merged" / "m-F32.gguf"), logits(base), logits(base, lora)
    gap = (merged - with_adapter).abs().max()
    print(f"LoRA GGUF over the f32 base vs the merge: max |logit difference| {gap:.2e}, the adapter moves them "
          f"{(merged - plain).abs().max():.2e}")
    assert gap < 1e-3 and (merged - plain).abs().max() > 100 * gap
    quantized, quantized_with = logits(work / "b-Q4_K_M.gguf"), logits(work / "b-Q4_K_M.gguf", lora)
    assert relative(quantized_with, merged) < 0.5 * relative(quantized, merged)


@pytest.mark.slow
def test_training_computes_with_the_gguf_llama_cpp_writes(sp_tokenizer, tmp_path):
    from qlora_fsdp.tools.llama_quantize import find_quantizer
    from tests.helpers import run_ranks, variable_length_samples

    needs_libggml()
    if find_quantizer() is None:
        pytest.skip("no llama.cpp quantizer (make llama-quantize)")
    model_dir = tiny_wide_llama(tmp_path / "model", sp_tokenizer)
    samples = variable_length_samples(export_config(model_dir, tmp_path / "cfg", "none"), 4)
    adapter = tmp_path / "adapter"
    one = run_ranks(through_export_side, 1, model_dir, tmp_path / "one", samples, None, tmp_dir=tmp_path)[0]
    two = run_ranks(through_export_side, 2, model_dir, tmp_path / "two", samples, adapter, tmp_dir=tmp_path)[0]
    files = gguf_files(adapter, tmp_path / "gguf")
    shape = ModelShape(n_layers=4, tied_head=False)
    print(json.dumps({name: {k: v for k, v in run.items() if k != "grads"} for name, run in (("ws1", one),
                                                                                            ("ws2", two))}))
    assert two["offloaded"] == pytest.approx(two["q4_k_m"], rel=1e-6)
    assert one["grads"].keys() == two["grads"].keys() and len(one["grads"]) == 4 * 7 * 2  # A and B, 7 linears
    for name, grad in one["grads"].items():  # one step's gradients through the rounding: the same on two ranks
        assert grad.abs().sum() > 0 and relative(two["grads"][name], grad) < 1e-5, name
    for target, file in files.items():
        reference = transformers_loss(file, samples)
        print(f"{target}: transformers on llama.cpp's file {reference:.7f}")
        for ours in (one, two):
            assert ours[target] == pytest.approx(reference, rel=2e-6), target
            assert abs(ours[target] - ours["none"]) > 1e-4 * ours["none"]  # the export changes the loss
        chosen = {name: tensor_type(target, name, row, shape) for name, (_, row) in gguf_types(file).items()}
        stored = {name: kind for name, (kind, _) in gguf_types(file).items()}
        assert {name: kind.lower() for name, kind in chosen.items()} == {n: k.lower() for n, k in stored.items()}
        if target == "q4_k_m":  # the mix: q6_K where llama.cpp keeps more bits, q4_K elsewhere
            assert stored["model.layers.2.mlp.down_proj"] == "Q6_K" and stored["model.layers.1.mlp.down_proj"] == "Q4_K"
            assert stored["lm_head"] == "Q6_K"
    lora_gguf_runs_as_its_merge(adapter, model_dir, tmp_path / "lora")


def test_what_training_through_the_export_cannot_do_is_refused_in_one_line(monkeypatch):
    """LoRA settings whose exported weight is not the merged 4-bit linear; a mixture of experts; a module whose
    llama.cpp type is not known here; rows llama-quantize refuses for q4_0."""
    from torch import nn
    from transformers import LlamaConfig

    from qlora_fsdp.config import load_config
    from qlora_fsdp.errors import ConfigError
    from qlora_fsdp.layers.experts4bit import Experts4bit
    from qlora_fsdp.loading.export_target import train_through_export

    for setting, named in (("lora.dropout=0.1", "lora.dropout"), ("lora.use_dora=true", "lora.use_dora"),
                           ("lora.target_experts=true", "lora.target_experts")):
        with pytest.raises(ConfigError, match=named):
            load_config("tiny_cpu", ["export.target=q4_k_m", setting])

    class WithExperts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = LlamaConfig(num_hidden_layers=2)
            self.experts = Experts4bit()

    with pytest.raises(ConfigError, match="experts.*export.target: none"):
        train_through_export(WithExperts(), load_config("tiny_cpu", ["export.target=q4_k_m"]))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU as a user's: the kernel does not run here
    with pytest.raises(ConfigError, match="export.rounding_kernel: fused needs a CUDA GPU"):
        train_through_export(nn.Linear(2, 2), load_config("tiny_cpu", ["export.target=q4_k_m",
                                                                         "export.rounding_kernel=fused"]))
    shape = ModelShape(n_layers=2, tied_head=True)
    with pytest.raises(ConfigError, match="model.layers.0.attn.c_attn is not known"):
        tensor_type("q4_k_m", "model.layers.0.attn.c_attn", 256, shape)
    with pytest.raises(ConfigError, match="rows of 48"):
        tensor_type("q4_0", "model.layers.0.self_attn.q_proj", 48, shape)
    assert tensor_type("q4_k_m", "model.embed_tokens", 576, shape) == "q8_0"  # tied: the head's q6_K, fallen back
    assert tensor_type("q4_k_m", "model.layers.1.mlp.down_proj", 1536, shape) == "q6_K"  # the last eighth
    assert tensor_type("q4_k_m", "model.layers.0.mlp.down_proj", 1536, shape) == "q4_K"
    assert tensor_type("q4_k_m", "model.layers.1.mlp.gate_proj", 576, shape) == "q5_0"  # q4_K's fallback


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[int, ...]]) -> Path:
    """A GGUF holding zero tensors of the given (torch-order) shapes."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(path, arch)
    for name, shape in tensors.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_lora_gguf_refuses_what_it_cannot_carry(tmp_path, capsys):
    """--lora-only: the file's alpha is PEFT's scaling times r (rsLoRA kept); DoRA, a tensor trained in full and
    per-module ranks refused; a --base-gguf that is not the adapter's base refused in one line; the flags that do
    not go together."""
    from safetensors.torch import save_file

    from qlora_fsdp.commands.export import main as export_main
    from qlora_fsdp.tools.gguf_export import GgufExportError
    from qlora_fsdp.tools.lora_gguf import check_base_gguf, lora_pairs

    module = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{module}.lora_A.weight": torch.ones(4, 8), f"{module}.lora_B.weight": torch.ones(6, 4)}

    def adapter(name: str, config: dict, extra: dict | None = None) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, **config}))
        save_file({**tensors, **(extra or {})}, folder / "adapter_model.safetensors")
        return folder

    rslora = lora_pairs(adapter("rslora", {"use_rslora": True}))
    assert rslora.alpha == pytest.approx(16.0)  # llama.cpp's alpha / r = 8 / sqrt(4), PEFT's scaling
    assert sorted(rslora.pairs) == ["model.layers.0.self_attn.q_proj.weight.lora_a",
                                    "model.layers.0.self_attn.q_proj.weight.lora_b"]
    assert lora_pairs(adapter("plain", {})).alpha == pytest.approx(8.0)
    for name, config, extra, message in (
            ("dora", {"use_dora": True}, None, "DoRA's magnitudes"),
            ("full", {}, {"base_model.model.lm_head.weight": torch.ones(6, 8)}, "'base_model.model.lm_head.weight'"),
            ("pattern", {"rank_pattern": {"q_proj": 2}}, None, "rank_pattern")):
        with pytest.raises(GgufExportError, match=message):
            lora_pairs(adapter(name, config, extra))
    lora = write_gguf(tmp_path / "lora.gguf", "llama", {"blk.0.attn_q.weight.lora_a": (4, 8),
                                                        "blk.0.attn_q.weight.lora_b": (6, 4)})
    check_base_gguf(write_gguf(tmp_path / "base.gguf", "llama", {"blk.0.attn_q.weight": (6, 8)}), lora)
    for name, arch, shape, message in (("narrow", "llama", {"blk.0.attn_q.weight": (6, 4)}, r"\[8, 6\].*\[4, 6\]"),
                                       ("none", "llama", {"blk.0.attn_k.weight": (6, 8)}, "no such tensor"),
                                       ("qwen", "qwen2", {"blk.0.attn_q.weight": (6, 8)}, "qwen2 model")):
        with pytest.raises(GgufExportError, match=message):
            check_base_gguf(write_gguf(tmp_path / f"{name}.gguf", arch, shape), lora)
    out = str(tmp_path / "out")
    for argv, message in ((["--model", str(tmp_path), "--lora-only"], "name it with --adapter"),
                          (["--adapter", str(tmp_path / "plain"), "--lora-only", "--outtype", "q4_k_m"],
                           "f32 or f16, not q4_k_m"),
                          (["--model", str(tmp_path), "--base-gguf", str(lora)], "goes with --lora-only"),
                          (["--adapter", str(tmp_path / "plain"), "--lora-only", "--ollama-create", "m"],
                           "needs --base-gguf")):
        assert export_main([*argv, "--out", out]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def test_the_kernels_compile_for_cuda_with_exact_float_instructions():
    """The rounding and search kernels compiled for sm_90 here (Triton's own ptxas; tests/kernel_ptx.py): every
    float32 add, subtract, multiply, divide and square root rounds to nearest on its own (`.rn`), no fused or
    approximate instruction, float16 written to nearest: the order the interpreter checks against the torch
    rounding is the order the GPU computes in. With Triton's default fusion the same kernel holds FMAs."""
    import os
    import subprocess
    import sys

    def instructions(*flags: str) -> dict[str, list[str]]:
        done = subprocess.run([sys.executable, "-m", "tests.kernel_ptx", *flags], capture_output=True, text=True,
                              env=os.environ | {"TRITON_INTERPRET": "0"}, cwd=Path(__file__).parent.parent, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    compiled = instructions()
    assert len(compiled) == len(TYPES) + 3
    for name, found in compiled.items():
        arithmetic = [i for i in found if not i.startswith("cvt.")]
        exact = [i for i in arithmetic if re.fullmatch(r"(add|sub|mul|div|sqrt)\.rn\.f32", i)]
        assert arithmetic and exact == arithmetic, (name, found)
        assert not [i for i in found if re.search(r"approx|ftz|full|sat", i)], (name, found)
        assert "cvt.rn.f16.f32" in found, (name, found)  # the merge written as float16, to nearest even
    assert any(i.startswith("fma.rn.f32") for i in instructions("--fusion")["rounding q4_K"])


@pytest.mark.old_torch  # reaches torch code that differs between releases (tests/version_paths.py)
def test_the_planner_prices_a_search_once_a_step(monkeypatch):
    """On fake tensors the first chunk is searched and the rest priced as its repeats, the whole once an optimizer
    step (the plan counts the first micro-batch `counted_for` times); a frozen weight's search, once a run, at
    nothing; the steps held have the whole weight's size. A forward's rounding with the kernel is priced at about 8
    bytes an element (bf16 base and weight, the float32 B A), in plain torch at 98."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from qlora_fsdp.gguf_target import quantizers
    from qlora_fsdp.gguf_target.through_export import SearchCache
    from qlora_fsdp.measure.op_work import op_work

    class Markers(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.repeats: list[float] = []
            self.traffic = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.qlora_fsdp.tile_work_end.default:
                self.repeats.append(args[1])
            out = func(*args, **(kwargs or {}))
            self.traffic += op_work(func, args, kwargs or {}, out, "forward", False, None).memory_bytes
            return out

    monkeypatch.setattr(quantizers, "CHUNK_ELEMENTS", 100 * 256)  # 10 chunks of 100 rows
    real = quantizers.block_steps(torch.randn(1000, 256), "q4_K")
    trained, frozen = SearchCache(counted_for=4), SearchCache(0)
    with FakeTensorMode(), Markers() as markers:
        weight, lora_a, lora_b = torch.randn(1000, 256), torch.randn(4, 256), torch.randn(1000, 4)
        for _ in range(2):  # the second micro-batch reuses the search
            exported_weight(weight, "q4_K", (lora_a, lora_b, 2.0), trained)
        exported_weight(weight, "q6_K", None, frozen)
    assert real is not None
    assert [s.shape for s in trained.steps] == [s.shape for s in real]
    assert [s.dtype for s in trained.steps] == [torch.float16, torch.int8] * 2
    assert [s.shape for s in frozen.steps] == [(1000, 1), (1000, 16)]
    assert markers.repeats == [pytest.approx(10 / 4 - 1), -1.0]
    bytes_an_element, trained = {}, SearchCache()
    with FakeTensorMode():
        weight, lora_a, lora_b = torch.randn(1000, 256).bfloat16(), torch.randn(4, 256), torch.randn(1000, 4)
        exported_weight(weight, "q4_K", (lora_a, lora_b, 2.0), trained, torch.bfloat16)  # searched once
        for fused in (True, False):
            with Markers() as counted:
                exported_weight(weight, "q4_K", (lora_a, lora_b, 2.0), trained, torch.bfloat16, fused)
            bytes_an_element[fused] = counted.traffic / weight.numel()
    assert 8 <= bytes_an_element[True] < 9 and bytes_an_element[False] > 10 * bytes_an_element[True], bytes_an_element
