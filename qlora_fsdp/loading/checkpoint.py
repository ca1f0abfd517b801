"""The checkpoint folder a recipe names (local, or fetched from the hub), its config and its tokenizer."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from qlora_fsdp.config import REPO_ROOT, Config
from qlora_fsdp.errors import ModelLoadError, first_line
from qlora_fsdp.families import refuse_unchecked_family, text_config
from qlora_fsdp.layers.text_decoder_lm import register_text_decoders
from qlora_fsdp.loading import stored_forms


@functools.cache
def fetched_folder(model_path: str) -> Path:
    """A local checkpoint folder as is; otherwise a hub id, fetched (config, tokenizer and safetensors only), once a
    process."""
    return fetched(model_path, ["*.json", "*.safetensors", "*.model", "*.txt"])


def check_model_path(model_path: str) -> None:
    """What fetched_folder would refuse, known in a second: a folder here, or a hub id whose config.json comes."""
    fetched(model_path, ["config.json"])


def fetched(model_path: str, patterns: list[str]) -> Path:
    path = Path(model_path)
    if path.is_dir():
        return path
    if path.exists() or model_path.startswith((".", "/")) or model_path.count("/") > 1:
        raise ModelLoadError(f"model.path '{model_path}' is not a checkpoint folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_path, allow_patterns=patterns))
    except Exception as err:  # offline, gated or unknown: say which, in one line
        raise ModelLoadError(f"model.path '{model_path}' is neither a local folder nor reachable on the hub "
                             f"({type(err).__name__}); for the tiny default run `make tiny-model`") from None


def model_dir(cfg: Config) -> Path:
    """The checkpoint folder model.path names: the one place model.path becomes a folder (everything that reads the
    checkpoint asks here; messages and the adapter's base_model_name_or_path keep the name as written)."""
    return fetched_folder(cfg.model.path)


def shipped_config_folder(cfg: Config) -> Path | None:
    """Where a plan reads a hub model's config.json: the repo's shipped copy (model_configs/<name>), so a plan needs
    no download; None where model.path is a local folder or no copy is shipped (model_dir's, then)."""
    shipped = REPO_ROOT / "model_configs" / cfg.model.path.rstrip("/").split("/")[-1].lower()
    if Path(cfg.model.path).is_dir() or not (shipped / "config.json").is_file():
        return None
    return shipped


def base_model_dir(cfg: Config) -> Path:
    """model.path as a folder with a config.json (asked first: without one, a tokenizer load fails obscurely)."""
    path = model_dir(cfg)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face checkpoint folder (point model.path "
                             "at the folder holding config.json, the tokenizer and the *.safetensors)")
    try:
        json.loads((path / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as err:  # transformers' own message names neither line nor cause
        raise ModelLoadError(f"{path / 'config.json'}: not valid JSON ({first_line(err)})") from None
    return path


def load_hf_config(cfg: Config) -> PretrainedConfig:
    path = base_model_dir(cfg)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except ValueError as err:  # JSON that is not a config, an unknown model_type, remote code refused
        raise ModelLoadError(f"{path / 'config.json'}: {first_line(err)}") from None
    stored_forms.refuse_untrainable_form(config, path / "config.json")
    stored_forms.refuse_contradicting_recipe(config, cfg.quant, path / "config.json")
    register_text_decoders()  # Qwen-VL's text models get a causal LM (transformers has none)
    refuse_unchecked_family(config, cfg.model.unchecked_family)
    text = text_config(config)  # a multimodal checkpoint trains its text model
    if text is not config and getattr(config, "quantization_config", None) is not None:
        text.quantization_config = config.quantization_config  # how the whole checkpoint is stored
    if text is not config and not hasattr(text, "tie_word_embeddings"):  # Qwen2.5-VL says it on the whole
        text.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
    if cfg.model.add_tokens:  # the new tokens' rows, where the stored vocabulary (often padded) has no room
        text.vocab_size = max(text.vocab_size, len(load_tokenizer(cfg)))
    return text


def load_tokenizer(cfg: Config) -> PreTrainedTokenizerBase:
    path = base_model_dir(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError, TypeError) as err:  # no or broken tokenizer files
        raise ModelLoadError(f"{path}: cannot load its tokenizer ({first_line(err)}); the folder needs "
                             "tokenizer.json or the tokenizer files of its model family") from None
    if tokenizer.pad_token is None:  # Llama 3 ships none; padding is masked out of loss and attention
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.model.add_tokens:
        tokenizer.add_tokens(list(cfg.model.add_tokens))
    return tokenizer


def checkpoint_folder(cfg: Config) -> Path | None:
    """The folder whose weights will be read; None for random weights (a hub id is then not fetched)."""
    if cfg.model.init == "random" and not Path(cfg.model.path).is_dir():
        return None
    return model_dir(cfg)
