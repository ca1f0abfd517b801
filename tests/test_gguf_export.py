"""Export to GGUF (qlora-export): llama.cpp's converter writes the file, transformers' GGUF reader (gguf==0.19.0, none
of the converter's code) reads it back as the independent check, tensor by tensor and by the logits.

SmolLM2-135M-Instruct's first 6 of 30 layers (real weights, tokenizer and template; tests/conftest.py:
`short_real_model_dir`; the figures measured below are of all 30) with a LoRA adapter is exported once as f16
(merged by our merge into the original weights, kept with --keep-merged) and held to PEFT on the base in float32,
with the adapter moving the logits far past the tolerance; its merged folder is exported once as q8_0. Tiny Llama,
Qwen3 and Gemma 3 models are exported as f16 and bf16 (and a Gemma 3 from an adapter, as users of the sentencepiece
families do) with a sentencepiece tokenizer built here (tests/sentencepiece_tokenizer.py), which the converter reads
by its format: a BPE tokenizer it identifies by a hash of its pre-tokenizer's output and refuses ones it does not
know, which the repo's 512-token tiny tokenizer is (a test below holds that refusal to one line). The Modelfile's
TEMPLATE is rendered by Go's own text/template as Ollama feeds it a chat (tests/ollama_go.py) and held to the
tokenizer's chat template.

k-quants are llama.cpp's own quantizer's (`make llama-quantize`: its prebuilt library): the merged SmolLM2 exported
as q4_k_m is run by llama.cpp itself (tests/llama_cpp_run.py: its tokenizer, its forward pass, greedy tokens) and
held to transformers on the merged checkpoint; without the quantizer, the f16 file and llama-quantize's command.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from gguf import GGUFReader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import qlora_fsdp.commands.export as export_command
from qlora_fsdp.commands.export import main as export_main
from qlora_fsdp.config import to_yaml
from qlora_fsdp.loading.adapter import TRAINING_CONFIG
from qlora_fsdp.tools.export_size import in_words, merged_size_bytes, parameter_count, size_bytes
from qlora_fsdp.tools.gguf_export import converter_dir
from qlora_fsdp.tools.llama_quantize import FTYPES, Quantizer, find_quantizer
from qlora_fsdp.tools.ollama import PROBE, hf_render, modelfile, translate
from tests import background, ollama_go
from tests.families import FAMILIES, SMALL, WINDOW
from tests.helpers import REPO, command_here, tiny_config

pytestmark = pytest.mark.slow  # the converter runs as a subprocess

# Go's toolchain fetched (a wheel from the package index) and the renderer built beside the tests before the ones
# that use it (once a machine: later runs find it built)
background.register("go_renderer", [sys.executable, "-m", "tests.ollama_go"],
                    env={**os.environ, "PYTHONPATH": str(REPO)})

CHAT = [{"role": "user", "content": "Reverse the letters of the word river."},
        {"role": "assistant", "content": "revir"}, {"role": "user", "content": "And of the word stone?"}]
Q8_BLOCK = 32
# Q8_0 per block of 32: d = amax/127, q = round(x/d), d stored as float16. |x - q*f16(d)| <= d/2 + 127*|d - f16(d)|
# <= amax/254 + amax*2^-11 (float16's half ulp, relative); a little float32 slack on top
Q8_BOUND = 1 / 254 + 2**-11 + 1e-6
# SmolLM2's f16 GGUF against PEFT on the base in float32 (relative norm of the logits): the merge rounds each weight
# to float16 (2^-11 relative) and nothing else differs; measured 5.5e-4 (largest logit off by 0.032). The adapter
# moves the logits by more than 10x this (measured 0.080), so a GGUF without it fails; a merge in bfloat16 measures
# 3.6e-3
F16_TOLERANCE = 2e-3
# a tiny model against its GGUF read back: the same weights (bf16 bit for bit; f16 but for float16's subnormals) in
# the same model class; measured 0 (bf16) and 3e-7 (f16, Qwen3)
TINY_TOLERANCE = 1e-5
# SmolLM2's Q4_K_M file run by llama.cpp against transformers on the merged checkpoint it was quantized from (float32;
# relative norm of the logits after a chat): measured 0.055, the same next token (0.07 on the model as released,
# whose f16 file measures 3.4e-4)
Q4_K_M_TOLERANCE = 0.15
WRITTEN = {"f16": torch.float16, "bf16": torch.bfloat16}  # what each outtype holds a matrix in (vectors: float32)


def chat_ids(tokenizer) -> torch.Tensor:
    return tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def load(model_dir: Path, gguf_file: str | None = None) -> torch.nn.Module:
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()


def logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits[0]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def export(argv: list) -> tuple[int, str, str]:
    result = command_here(export_main, argv)
    return result.returncode, result.stdout, result.stderr


def one_gguf(folder: Path) -> str:
    (file,) = [path.name for path in folder.glob("*.gguf")]
    return file


def gguf_types(path: Path) -> dict[int, set[str]]:
    """The GGUF's tensor types by number of dimensions, as the file records them (e.g. {1: {'F32'}, 2: {'F16'}})."""
    types: dict[int, set[str]] = {}
    for tensor in GGUFReader(path).tensors:
        types.setdefault(len(tensor.shape), set()).add(tensor.tensor_type.name)
    return types


def beyond_f16_rounding(read: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> list[str]:
    """The tensors read back further from the exact (float32) ones than float16's rounding puts them: half its step at
    each value (2^-25 for subnormals), and 2^-8 of that for float32's own rounding of the exact sum."""
    beyond = []
    for key, tensor in exact.items():
        exponent = torch.floor(torch.log2(tensor.abs().clamp_min(2**-14)))
        if ((read[key] - tensor).abs() > 2.0 ** (exponent - 11) * (1 + 2**-8)).any():
            beyond.append(key)
    return beyond


def written_diff(read: dict[str, torch.Tensor], source: dict[str, torch.Tensor],
                 dtype: torch.dtype) -> tuple[list[str], float]:
    """(the tensors read back unlike the source rounded to `dtype`, the largest |read - source|): each matrix must be
    the source rounded to nearest in `dtype`, bit for bit, and each vector the source itself (llama.cpp writes norms
    in float32)."""
    assert read.keys() == source.keys()
    unlike, largest = [], 0.0
    for key, tensor in source.items():
        expected = tensor.to(dtype).float() if tensor.dim() > 1 else tensor
        if not torch.equal(read[key], expected):
            unlike.append(key)
        largest = max(largest, float((read[key] - tensor).abs().max()))
    return unlike, largest


@pytest.fixture(scope="module", autouse=True)
def converter_installed():
    assert (converter_dir() / "convert_hf_to_gguf.py").is_file(), "make gguf-converter installs llama.cpp's converter"


def write_lora_adapter(base: Path, out: Path) -> Path:
    """A PEFT LoRA adapter of `base` far from its init (seeded), with the tokenizer and a training_config.yaml as
    train.py writes them."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(0)  # PEFT draws A at random: the same adapter, and so the same figures, every run
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    peft_model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    cfg = tiny_config(base, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    (out / TRAINING_CONFIG).write_text(to_yaml(cfg))
    return out


@pytest.fixture(scope="module")
def go_renderer() -> Path:
    """Go's text/template rendering chats as Ollama does (tests/ollama_go.py); skips where Go cannot be had."""
    background.result("go_renderer")  # its failure aside: the call below repeats it and says why
    try:
        return ollama_go.renderer()
    except ollama_go.GoUnavailable as err:
        pytest.skip(f"Go's text/template unavailable: {err}")


@pytest.fixture(scope="module")
def smol_f16(short_real_model_dir, tmp_path_factory):
    """SmolLM2 + a LoRA adapter exported once as f16, the merged checkpoint kept beside it: (out, stdout). Merged into
    the original weights (--base-weights original), so that PEFT on the base as released is the reference (the merge
    into the 4-bit weights training saw, the default, is held to PEFT on the 4-bit base by the merge's own tests)."""
    root = tmp_path_factory.mktemp("smol-gguf")
    adapter = write_lora_adapter(short_real_model_dir, root / "run" / "adapter")
    code, out, err = export(["--adapter", adapter, "--out", root / "gguf", "--keep-merged", "--base-weights",
                             "original"])
    assert code == 0, err
    return root / "gguf", out


class PeftReference(NamedTuple):
    input_ids: torch.Tensor  # a chat's
    adapted: torch.Tensor  # its logits with the adapter
    base: torch.Tensor  # and without it
    merged: dict[str, torch.Tensor]  # PEFT's merge of the adapter, in float32


@pytest.fixture(scope="module")
def smol_peft(smol_f16, short_real_model_dir) -> PeftReference:
    """PEFT's adapter on the base in float32: transformers and PEFT, none of our loading or merging."""
    from peft import PeftModel

    input_ids = chat_ids(AutoTokenizer.from_pretrained(short_real_model_dir))
    model = PeftModel.from_pretrained(load(short_real_model_dir), smol_f16[0].parent / "run" / "adapter")
    with torch.no_grad():
        adapted = model(input_ids=input_ids).logits[0]
        with model.disable_adapter():
            base = model(input_ids=input_ids).logits[0]
    return PeftReference(input_ids, adapted, base, model.merge_and_unload().state_dict())


@pytest.fixture(scope="module")
def smol_merged(smol_f16):
    """The merged checkpoint (float16, as an f16 export merges) in float32: the source of the f16 GGUF's tensors and
    of the q8_0 export."""
    return load(smol_f16[0] / "merged")


def test_f16_export_of_an_adapter_computes_peft_on_the_base(smol_f16, smol_peft, smol_merged):
    folder, stdout = smol_f16
    gguf_file = one_gguf(folder)
    read = load(folder, gguf_file)
    moved = relative(smol_peft.adapted, smol_peft.base)
    error = relative(logits(read, smol_peft.input_ids), smol_peft.adapted)
    assert moved > 10 * F16_TOLERANCE  # a GGUF without the adapter cannot pass the next line
    assert error < F16_TOLERANCE
    assert gguf_types(folder / gguf_file) == {1: {"F32"}, 2: {"F16"}}
    # every tensor is PEFT's merge rounded to float16 (measured: 1.9e-3 at most, half a step), and the one our merge
    # wrote in float16, bit for bit (f16 holds it exactly)
    assert beyond_f16_rounding(read.state_dict(), smol_peft.merged) == []
    assert written_diff(read.state_dict(), smol_merged.state_dict(), torch.float16) == ([], 0.0)
    assert gguf_file == "run-F16.gguf" and f"llama-cli -m {folder / 'run-F16.gguf'}" in stdout
    assert "ollama create run -f Modelfile" in stdout and "ollama run run" in stdout


def test_the_gguf_tokenizer_encodes_a_chat_as_ours(smol_f16):
    folder, _ = smol_f16
    ours = AutoTokenizer.from_pretrained(folder / "merged")
    from_gguf = AutoTokenizer.from_pretrained(folder, gguf_file=one_gguf(folder))
    assert from_gguf.chat_template == ours.chat_template
    assert chat_ids(from_gguf).tolist() == chat_ids(ours).tolist()
    assert from_gguf.eos_token == ours.eos_token == "<|im_end|>"


def modelfile_commands(text: str) -> dict[str, str]:
    """A Modelfile's FROM, TEMPLATE and SYSTEM: a triple-quoted value verbatim (Ollama unescapes nothing in it)."""
    pattern = r'^(FROM|TEMPLATE|SYSTEM) (?:"""(.*?)"""|([^\n]*))$'
    return {m[1]: m[2] if m[2] is not None else m[3] for m in re.finditer(pattern, text, flags=re.S | re.M)}


def test_modelfile_translates_the_chatml_template_with_its_default_system_prompt(smol_f16, go_renderer):
    folder, _ = smol_f16
    text = (folder / "Modelfile").read_text()
    commands = modelfile_commands(text)
    tokenizer = AutoTokenizer.from_pretrained(folder / "merged")
    chats = [PROBE, PROBE[1:], CHAT]
    # Ollama's rendering of the Modelfile (Go's text/template, a chat's system message or the Modelfile's SYSTEM) is
    # what the model was trained on: the tokenizer's chat template
    rendered = ollama_go.render(go_renderer, [(commands.get("TEMPLATE", ""), commands.get("SYSTEM", ""), chat)
                                              for chat in chats])
    assert rendered == [hf_render(tokenizer, chat) for chat in chats]
    assert text.startswith("FROM ./run-F16.gguf\n")
    assert commands.get("SYSTEM") == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert 'PARAMETER stop "<|im_end|>"' in text


def q8_errors(merged: dict[str, torch.Tensor], read: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each weight's largest error as a share of its 32-block's largest magnitude (Q8_0's blocks run along rows)."""
    errors = {}
    for key, weight in merged.items():
        if weight.dim() != 2 or weight.shape[1] % Q8_BLOCK:
            continue
        blocks = weight.float().reshape(-1, Q8_BLOCK)
        error = (read[key].float().reshape(-1, Q8_BLOCK) - blocks).abs().amax(dim=1)
        errors[key] = float((error / blocks.abs().amax(dim=1).clamp_min(1e-30)).max())
    return errors


def test_q8_0_export_of_a_merged_folder_is_within_its_rounding(smol_f16, smol_merged, tmp_path):
    merged_dir = smol_f16[0] / "merged"
    merged, input_ids = smol_merged, chat_ids(AutoTokenizer.from_pretrained(merged_dir))
    ref = logits(merged, input_ids)
    code, _, err = export(["--model", merged_dir, "--out", tmp_path / "q8", "--outtype", "q8_0"])
    assert code == 0, err
    file = one_gguf(tmp_path / "q8")
    assert file == "merged-Q8_0.gguf"
    read = AutoModelForCausalLM.from_pretrained(tmp_path / "q8", gguf_file=file, dtype=torch.float32).eval()
    errors = q8_errors(merged.state_dict(), read.state_dict())
    layers = json.loads((merged_dir / "config.json").read_text())["num_hidden_layers"]
    assert len(errors) == layers * 7 + 2  # every projection of every layer, the embedding and lm_head (tied to it)
    assert max(errors.values()) <= Q8_BOUND
    assert min(errors.values()) > 1e-3  # each one was quantized (f16 alone would be 2^-11 at most)
    with torch.no_grad():
        got = read(input_ids=input_ids).logits[0]
    # weights off by up to 1/254 of their block's largest, through 30 layers: measured 0.03; a wrong layout is ~1
    assert 1e-4 < relative(got, ref) < 0.06


def test_the_size_printed_before_writing_is_the_files_but_its_tokenizer(smol_f16, monkeypatch):
    """merged_size_bytes (the studio's too): the base's parameters from its config, times the type's bytes."""
    folder, stdout = smol_f16
    adapter = folder.parent / "run" / "adapter"
    estimate, written = merged_size_bytes(adapter, "f16"), (folder / "run-F16.gguf").stat().st_size
    # the GGUF adds its tokenizer (49152 tokens and their merges) and metadata: measured 0.7% more
    assert 0.98 * written < estimate < written
    parameters = estimate // 2  # f16: two bytes each
    assert parameters == parameter_count(folder / "merged")  # the base's count is the merged checkpoint's
    line = f"writing about {in_words(estimate)} (f16, {parameters / 1e6:.0f}M parameters)\n"
    assert stdout.index(line) < stdout.index("exported")  # before anything is written
    assert merged_size_bytes(adapter, "bfloat16") == estimate and merged_size_bytes(adapter, "float32") == 2 * estimate
    assert size_bytes(10**9, "q4_k_m") == 606_250_000 and size_bytes(10**9, "q5_k_m") == 711_250_000
    # the studio's After tab says the same before a merge or an export, and who writes a k-quant
    from qlora_fsdp.studio import export_view

    line = export_view.sizes_line(str(adapter), "q4_k_m")
    assert line.startswith(f"Merge writes about {in_words(estimate)} (bfloat16); Export GGUF about "
                           f"{in_words(size_bytes(parameters, 'q4_k_m'))} (q4_k_m), by llama.cpp's quantizer")
    assert export_view.default_gguf_type() == "q4_k_m" and export_view.sizes_line(str(folder), "f16") == ""
    monkeypatch.setattr(export_view, "find_quantizer", lambda: None)  # a machine without llama.cpp's quantizer
    assert (f": llama.cpp's quantizer is not installed (make llama-quantize), so the f16 file "
            f"({in_words(estimate)}) is written") in export_view.sizes_line(str(adapter), "q5_k_m")
    assert export_view.default_gguf_type() == "f16"


@pytest.fixture(scope="module")
def llama_quantizer() -> Quantizer:
    """llama.cpp's quantizer (`make llama-quantize`, part of `make test`): skips where absent, but not in CI."""
    quantizer = find_quantizer()
    if quantizer is None:
        if os.environ.get("CI"):
            pytest.fail("llama.cpp's quantizer is not installed: `make test` installs it (make llama-quantize)")
        pytest.skip("llama.cpp's quantizer is not installed: make llama-quantize")
    return quantizer


def run_in_llama_cpp(quantizer: Quantizer, gguf: Path, prompt: str, lora: Path | None = None) -> dict:
    """llama.cpp's own run of the file (tests/llama_cpp_run.py, a subprocess), with a LoRA GGUF where given: its
    tokens for the prompt, the logits after it, 8 greedy tokens; skips where the quantizer is a binary (no library to
    run with)."""
    if quantizer.lib_dir is None:
        pytest.skip(f"llama.cpp's quantizer is a binary ({quantizer.binary}): no library to run the file with")
    command = [sys.executable, "-m", "tests.llama_cpp_run", str(quantizer.lib_dir), str(gguf), prompt, "8"]
    done = subprocess.run(command + ([str(lora)] if lora else []), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_q4_k_m_is_written_by_llama_cpp_and_runs_in_it(smol_f16, smol_merged, llama_quantizer, tmp_path):
    merged_dir, out = smol_f16[0] / "merged", tmp_path / "q4"
    code, stdout, err = export(["--model", merged_dir, "--out", out, "--outtype", "q4_k_m"])
    assert code == 0, err
    assert sorted(path.name for path in out.iterdir()) == ["Modelfile", "merged-Q4_K_M.gguf"]  # the f16: removed
    assert (out / "Modelfile").read_text().startswith("FROM ./merged-Q4_K_M.gguf\n")
    reader = GGUFReader(out / "merged-Q4_K_M.gguf")
    assert int(reader.fields["general.file_type"].parts[-1][0]) == FTYPES["q4_k_m"]
    # Q4_K_M's mix: Q4_K and Q6_K where a row is a multiple of 256 wide (SmolLM2's 1536-wide down projections),
    # llama.cpp's fallbacks (Q5_0, Q8_0) for its 576-wide rows; norms in F32, nothing left in F16
    assert {"Q4_K", "Q6_K"} <= gguf_types(out / "merged-Q4_K_M.gguf")[2] <= {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    assert "llama.cpp's quantizer" in stdout and "llama-quantize" not in stdout
    assert f"llama-cli -m {out / 'merged-Q4_K_M.gguf'}" in stdout
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ran = run_in_llama_cpp(llama_quantizer, out / "merged-Q4_K_M.gguf", prompt)
    assert ran["prompt_ids"] == chat_ids(tokenizer)[0].tolist()  # the file's tokenizer, in llama.cpp, is ours
    reference = logits(smol_merged, chat_ids(tokenizer))[-1]
    assert relative(torch.tensor(ran["logits"]), reference) < Q4_K_M_TOLERANCE
    assert ran["generated"][0] == int(reference.argmax())
    assert len(ran["generated"]) == 8 and tokenizer.decode(ran["generated"]).strip()


def test_q5_k_m_keeps_its_f16_on_request_and_ollama_creates_it(smol_f16, llama_quantizer, tmp_path, monkeypatch):
    """--keep-f16 keeps the file it was quantized from; --ollama-create runs Ollama's command in the folder (a
    stand-in `ollama` on PATH records how it was called)."""
    stand_in, calls = tmp_path / "bin" / "ollama", tmp_path / "calls"
    stand_in.parent.mkdir()
    stand_in.write_text(f"#!/bin/sh\necho \"$PWD $*\" >> {calls}\nhead -n 1 Modelfile >> {calls}\n")
    stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stand_in.parent}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "q5"
    code, stdout, err = export(["--model", smol_f16[0] / "merged", "--out", out, "--outtype", "q5_k_m", "--keep-f16",
                                "--ollama-create", "smol:q5"])
    assert code == 0, err
    assert sorted(path.name for path in out.iterdir()) == ["Modelfile", "merged-F16.gguf", "merged-Q5_K_M.gguf"]
    reader = GGUFReader(out / "merged-Q5_K_M.gguf")
    assert int(reader.fields["general.file_type"].parts[-1][0]) == FTYPES["q5_k_m"]
    assert "Q5_K" in gguf_types(out / "merged-Q5_K_M.gguf")[2]
    assert gguf_types(out / "merged-F16.gguf") == {1: {"F32"}, 2: {"F16"}}
    assert calls.read_text() == f"{out} create smol:q5 -f Modelfile\nFROM ./merged-Q5_K_M.gguf\n"
    assert f"the f16 file it was quantized from: {out / 'merged-F16.gguf'}" in stdout
    assert "ollama create smol:q5: done (ollama run smol:q5)" in stdout


def tiny_family(family: str, tokenizer, out: Path) -> Path:
    """tests/families.py's tiny model with a real tokenizer, set as the family's released models are where the GGUF
    (or transformers' reader of it) has no key for a setting: Qwen3's head_dim 128 (the reader takes it from
    Qwen3's default, not attention.key_length); Gemma 3's query_pre_attn_scalar = head_dim (llama.cpp scales by
    head_dim; the reader takes Gemma 3's default 256), five sliding layers to one full one (llama.cpp's fixed pattern)
    and no rope scaling (the reader drops it), as in 270M and 1B."""
    config = FAMILIES[family](tokenizer)
    if family == "qwen3":
        config.head_dim = 128
    if family == "gemma3":
        tokens = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                  "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
        config = AutoConfig.for_model("gemma3_text", **{**SMALL, **tokens, "num_hidden_layers": 6}, head_dim=256,
                                      query_pre_attn_scalar=256, sliding_window=WINDOW,
                                      layer_types=["sliding_attention"] * 5 + ["full_attention"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers 5 saves no tokenizer.model: the sentencepiece model is copied as released models ship it (the
    # converter reads the vocabulary from it; without it, it refuses the tokenizer as an unknown BPE one)
    shutil.copy(Path(tokenizer.name_or_path) / "tokenizer.model", out)
    return out


@pytest.mark.parametrize(("family", "outtype"), [("llama", "q4_k_m"), ("qwen3", "f16"), ("gemma3", "bf16")])
def test_tiny_families_export_and_read_back_equal(family, outtype, sp_tokenizer, tmp_path, monkeypatch):
    """bf16 holds the checkpoint's bf16 weights exactly, f16 as float16 rounds them (only subnormals change); a
    k-quant where no llama.cpp quantizer is installed writes f16, prints llama.cpp's command and the install step."""
    monkeypatch.setattr(export_command, "find_quantizer", lambda: None)
    model_dir = tiny_family(family, sp_tokenizer, tmp_path / family)
    code, stdout, err = export(["--model", model_dir, "--out", tmp_path / "gguf", "--outtype", outtype])
    assert code == 0, err
    written = "bf16" if outtype == "bf16" else "f16"
    gguf_file = one_gguf(tmp_path / "gguf")
    assert gguf_file == f"{family}-{written.upper()}.gguf"
    if outtype == "q4_k_m":
        gguf = tmp_path / "gguf" / gguf_file
        assert f"llama-quantize {gguf} {gguf.with_name(f'{family}-Q4_K_M.gguf')} Q4_K_M\n" in stdout
        assert "no llama.cpp quantizer is installed: make llama-quantize installs one" in stdout
    ours, read = load(model_dir), load(tmp_path / "gguf", gguf_file)
    assert gguf_types(tmp_path / "gguf" / gguf_file) == {1: {"F32"}, 2: {written.upper()}}
    unlike, largest = written_diff(read.state_dict(), ours.state_dict(), WRITTEN[written])
    assert unlike == [] and largest <= (0.0 if written == "bf16" else 2**-25)  # f16: half its subnormals' step
    input_ids = chat_ids(sp_tokenizer)
    assert input_ids.shape[1] > WINDOW  # past the sliding window: Gemma 3's sliding layers are under test
    assert relative(logits(read, input_ids), logits(ours, input_ids)) < TINY_TOLERANCE


def test_a_sentencepiece_family_exports_from_an_adapter_with_its_vocabulary(sp_tokenizer, tmp_path):
    """Gemma 3 as released, with a sentencepiece tokenizer.model beside tokenizer.json, exported as bf16. Saving the
    adapter's tokenizer writes no tokenizer.model (transformers 5), so the merge takes the base's: the converter then
    writes the sentencepiece vocabulary."""
    base = tiny_family("gemma3", sp_tokenizer, tmp_path / "gemma3")
    adapter = write_lora_adapter(base, tmp_path / "run" / "adapter")
    assert not (adapter / "tokenizer.model").exists()
    code, _, err = export(["--adapter", adapter, "--out", tmp_path / "gguf", "--keep-merged", "--outtype", "bf16"])
    assert code == 0, err
    gguf_file, merged = one_gguf(tmp_path / "gguf"), tmp_path / "gguf" / "merged"
    assert (merged / "tokenizer.model").read_bytes() == (base / "tokenizer.model").read_bytes()
    fields = GGUFReader(tmp_path / "gguf" / gguf_file).fields
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "llama"  # sentencepiece's, not "gpt2"
    from_gguf = AutoTokenizer.from_pretrained(tmp_path / "gguf", gguf_file=gguf_file)
    input_ids = chat_ids(sp_tokenizer)
    assert chat_ids(from_gguf).tolist() == input_ids.tolist()
    ours, read = load(merged), load(tmp_path / "gguf", gguf_file)
    # the merge wrote bfloat16, which bf16 holds exactly: every tensor read back is the merge's, bit for bit
    assert written_diff(read.state_dict(), ours.state_dict(), torch.bfloat16) == ([], 0.0)
    assert relative(logits(read, input_ids), logits(ours, input_ids)) < TINY_TOLERANCE


def test_an_existing_target_is_never_clobbered(real_model_dir, tmp_path):
    out = tmp_path / "gguf"
    out.mkdir()
    (out / "old-F16.gguf").write_bytes(b"GGUF\x03\x00")  # a truncated file from an interrupted export
    code, _, err = export(["--model", real_model_dir, "--out", out])
    assert code == 2
    assert err == f"error: {out} exists and is not empty: choose another --out, or pass --overwrite\n"
    assert [path.name for path in out.iterdir()] == ["old-F16.gguf"]
    assert (out / "old-F16.gguf").read_bytes() == b"GGUF\x03\x00"


def test_the_source_folder_is_never_the_target_even_with_overwrite(tmp_path):
    model_dir = tmp_path / "merged"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    code, _, err = export(["--model", model_dir, "--out", tmp_path, "--overwrite"])
    assert code == 2
    assert err == f"error: --out {tmp_path} is (or holds) the folder being exported: choose another --out\n"
    assert (model_dir / "config.json").read_text() == "{}"


def test_an_adapter_whose_base_is_missing_is_refused(smol_f16, tmp_path):
    adapter = smol_f16[0].parent / "run" / "adapter"
    code, _, err = export(["--adapter", adapter, "--out", tmp_path / "gguf", f"model.path={tmp_path / 'gone'}"])
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: model.path '{tmp_path / 'gone'}' is not") and not (tmp_path / "gguf").exists()


def test_a_family_the_converter_lacks_is_refused_before_anything_is_written(tmp_path):
    """JetMoe (a mixture of experts transformers has) has no class in the converter."""
    model_dir = tmp_path / "jetmoe"
    AutoConfig.for_model("jetmoe").save_pretrained(model_dir)
    code, _, err = export(["--model", model_dir, "--out", tmp_path / "gguf"])
    assert code == 2
    assert err == ("error: llama.cpp's converter (convert-hf-to-gguf) cannot export JetMoeForCausalLM: it has no class "
                   "for this architecture; export the merged checkpoint with a llama.cpp that supports it\n")
    assert not (tmp_path / "gguf").exists() and not (tmp_path / "gguf.tmp").exists()


def test_a_tokenizer_the_converter_does_not_know_fails_in_one_line_and_leaves_nothing(tiny_model_dir, tmp_path):
    code, _, err = export(["--model", tiny_model_dir, "--out", tmp_path / "gguf"])
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: llama.cpp's converter failed on {tiny_model_dir}: its tokenizer's pre-tokenizer is "
                          "not one llama.cpp knows")
    assert list(tmp_path.iterdir()) == []


def test_the_converters_gguf_does_not_replace_ours():
    """The converter's wheel ships a `gguf` package: installed apart, ours (which transformers reads with) stays."""
    import importlib.metadata

    import gguf

    assert importlib.metadata.version("gguf") == "0.19.0"
    assert not Path(gguf.__file__).is_relative_to(converter_dir())
    assert (converter_dir() / "gguf" / "__init__.py").is_file()


# turn formats written here in the families' shapes (no such template ships with a local model): the translation
# must reproduce them, system message folded into the first user turn (Gemma) or a turn of its own (Llama 3)
GEMMA_STYLE = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
               "{% set first = messages[0]['content'] + '\\n\\n' %}{% set messages = messages[1:] %}"
               "{% else %}{% set first = '' %}{% endif %}{% for m in messages %}"
               "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
               "{{ (first if loop.first else '') + m['content'] + '<end_of_turn>\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
LLAMA3_STYLE = ("{{ bos_token }}{% for m in messages %}"
                "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
                "{{ m['content'] + '<|eot_id|>' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
CHATML_WITHOUT_NEWLINES = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + m['content'] + '<|im_end|>' }}"
                           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant' }}{% endif %}")


@pytest.mark.parametrize(("source", "adds_bos", "family"), [
    (GEMMA_STYLE, True, "gemma"), (LLAMA3_STYLE, True, "llama3"),
    (LLAMA3_STYLE, False, None),  # BOS written by the template alone: Ollama's per-turn template would repeat it
    (CHATML_WITHOUT_NEWLINES, True, None), ("{{ messages[0]['content'] }}", True, None)])
def test_a_template_is_translated_only_where_it_renders_chats_the_same(source, adds_bos, family, tiny_model_dir,
                                                                       go_renderer):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, add_bos_token=adds_bos)
    tokenizer.chat_template = source
    translation = translate(tokenizer)
    assert (translation.family and translation.family.name) == family
    if family is not None:
        chats = [PROBE, PROBE[1:], CHAT]  # Ollama's rendering (Go's text/template) against the template's own
        rendered = ollama_go.render(go_renderer, [(translation.family.template, "", chat) for chat in chats])
        assert rendered == [hf_render(tokenizer, chat) for chat in chats]
        assert translation.system == ""
    else:
        assert "no TEMPLATE written" in translation.note
        assert "TEMPLATE" not in modelfile("x.gguf", translation, []).replace("no TEMPLATE", "")


def test_a_vision_language_checkpoint_exports_its_projector_beside_the_text_model(sp_tokenizer, tmp_path):
    """Gemma 3 with its vision tower: the text GGUF and llama.cpp's vision projector file (mmproj) beside it, whose
    tower and projector tensors are the checkpoint's (f32: exact); the printed command reads images with both."""
    from safetensors.torch import load_file, save_file

    from tests.vision_models import write_tiny_gemma3

    model_dir = write_tiny_gemma3(tmp_path / "vlm", AutoTokenizer.from_pretrained(sp_tokenizer.name_or_path))
    shutil.copy(Path(sp_tokenizer.name_or_path) / "tokenizer.model", model_dir)  # as released (see tiny_family)
    # the tower's keys as Google's released files spell them (transformers 5 saves them without `vision_model.`,
    # which the converter cannot map)
    weights = load_file(model_dir / "model.safetensors")
    save_file({key.replace("vision_tower.", "vision_tower.vision_model.", 1): value for key, value in weights.items()},
              model_dir / "model.safetensors", metadata={"format": "pt"})
    code, stdout, err = export(["--model", model_dir, "--out", tmp_path / "gguf", "--outtype", "f32"])
    assert code == 0, err
    assert sorted(path.name for path in (tmp_path / "gguf").glob("*.gguf")) == ["mmproj-vlm-F32.gguf", "vlm-F32.gguf"]
    projector = tmp_path / "gguf" / "mmproj-vlm-F32.gguf"
    assert f"llama-mtmd-cli -m {tmp_path / 'gguf' / 'vlm-F32.gguf'} --mmproj {projector} --image" in stdout
    written = {tensor.name: torch.from_numpy(tensor.data.copy()) for tensor in GGUFReader(projector).tensors}
    stored = load_file(model_dir / "model.safetensors")
    query = stored["vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight"].float()
    assert torch.equal(written["v.blk.0.attn_q.weight"].reshape(query.shape), query)
    assert not any(name.startswith("blk.") for name in written)  # the decoder is the text file's


def test_a_vision_language_family_without_a_projector_class_is_refused_before_anything_is_written(tmp_path):
    """PaddleOCR-VL: the converter writes its text model but has no mmproj class; the text model alone would lose
    the images, so the export is refused in one line saying what llama.cpp needs."""
    model_dir = tmp_path / "paddle"
    config = AutoConfig.for_model("paddleocr_vl")
    config.architectures = ["PaddleOCRVLForConditionalGeneration"]
    config.save_pretrained(model_dir)
    code, _, err = export(["--model", model_dir, "--out", tmp_path / "gguf"])
    assert code == 2
    assert err == ("error: llama.cpp's converter cannot write the vision projector (mmproj) of "
                   "PaddleOCRVLForConditionalGeneration, which llama.cpp needs beside the text model to read images; "
                   "export the merged checkpoint with a llama.cpp whose converter has an mmproj class for it\n")
    assert not (tmp_path / "gguf").exists() and not (tmp_path / "gguf.tmp").exists()
