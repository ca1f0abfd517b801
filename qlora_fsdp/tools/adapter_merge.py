"""Merge a LoRA adapter into its base, one tensor at a time, into a plain Hugging Face checkpoint.

By default every weight that training held in 4-bit is quantized and dequantized exactly as the loader did,
so the merged model computes what base + adapter computed during training (the adapter learned to work
with the quantization error). `base_weights="original"` adds the adapter to the unquantized weights instead.
Host RAM stays near one output shard plus one weight: nothing holds the whole model.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig

from qlora_fsdp.config import Config, DType
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.errors import ConfigError, ModelLoadError
from qlora_fsdp.families import is_multimodal, quant_method, text_config
from qlora_fsdp.layers.expert_lora import expert_loras
from qlora_fsdp.layers.experts4bit import LORA_SUFFIX, ExpertMatrix
from qlora_fsdp.layers.lora_inits import initial_adapter
from qlora_fsdp.layers.lora_math import dora_magnitude, expert_delta, lora_scale
from qlora_fsdp.loading.adapter import adapter_file_key, read_adapter
from qlora_fsdp.loading.build import build_meta_model
from qlora_fsdp.loading.checkpoint import load_hf_config, model_dir
from qlora_fsdp.loading.fill import base_targets, model_layout, model_shapes
from qlora_fsdp.loading.initial_adapter import initialized, round_trip
from qlora_fsdp.loading.layout import meta_full_model
from qlora_fsdp.loading.names import PEFT_PREFIX, is_lora_tensor, weight_key
from qlora_fsdp.loading.nf4 import as_trained
from qlora_fsdp.loading.reader import CheckpointReader, Experts, FourBit, Piece
from qlora_fsdp.precision import describe_device
from qlora_fsdp.run.description import describe_run


@dataclass
class LoraDelta:
    a: torch.Tensor  # r x in
    b: torch.Tensor  # out x r
    scale: float
    magnitude: torch.Tensor | None  # DoRA: the learned norm of each output row

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """W + s B A in fp32; for DoRA, each row then rescaled to its learned magnitude (PEFT's definition)."""
        # the adapter is read onto the CPU; the weight may be on the merge device (--device cuda)
        a, b = self.a.to(weight.device).float(), self.b.to(weight.device).float()
        combined = weight.float() + self.scale * (b @ a)
        if self.magnitude is None:
            return combined
        norms = dora_magnitude(combined, torch.float32)  # the merged rows' norms, as DoRA's init takes them
        return combined * (self.magnitude.to(weight.device).float() / norms).unsqueeze(1)


@dataclass
class ExpertDelta:
    """LoRA on a fused experts parameter, in PEFT's layout: a [r * experts, in], b [out, r * experts]."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    n_experts: int
    transposed: bool  # each expert stored [in, out] (gpt-oss)

    def merged(self, expert: int, weight: torch.Tensor) -> torch.Tensor:
        """One expert's matrix + s B_e A_e, in fp32."""
        delta = expert_delta(self.a, self.b, self.n_experts, expert, self.scale, self.transposed)
        return weight.float() + delta.to(weight.device)


@dataclass
class AdapterUpdates:
    """What an adapter changes, by base checkpoint key: LoRA on linear weights, LoRA on fused experts, and the
    tensors it trained in full (routers: PEFT's modules_to_save)."""

    linear: dict[str, LoraDelta]
    experts: dict[str, ExpertDelta]
    replaced: dict[str, torch.Tensor]
    tied: dict[str, str] = field(default_factory=dict)  # a trained tensor's second name -> its first (a tied head)

    def unused(self) -> str | None:
        # a tied head's name that the checkpoint does not store was written under its twin's
        written_twice = {key for key, twin in self.tied.items() if twin not in self.replaced}
        return next(iter([*self.linear, *self.experts, *(set(self.replaced) - written_twice)]), None)


def adapter_updates(adapter_dir: Path, meta: nn.Module) -> AdapterUpdates:
    """A PEFT adapter folder read as updates of the base checkpoint's keys (`...q_proj.weight`); `meta` is the model
    the adapter was trained on, which says which tensors are experts' LoRA and which trained in full."""
    config, tensors = read_adapter(adapter_dir)
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ModelLoadError("adapters with per-module rank_pattern/alpha_pattern are not supported by the merge")
    scale = lora_scale(config["r"], config["lora_alpha"], bool(config.get("use_rslora")))
    layout = model_layout(meta)

    def saved(name: str) -> bool:  # the adapter decides what it changes (PEFT's own adapters have no experts' LoRA)
        return adapter_file_key(name, layout) in tensors

    def take(name: str) -> torch.Tensor:
        return tensors.pop(adapter_file_key(name, layout))

    def base_key(name: str) -> str:
        return layout.full_from_ours(weight_key(name))

    experts = {base_key(name): ExpertDelta(take(f"{name}{LORA_SUFFIX}.lora_A"), take(f"{name}{LORA_SUFFIX}.lora_B"),
                                           scale, lora.n_experts, lora.transposed)
               for name, lora in expert_loras(meta).items() if saved(f"{name}{LORA_SUFFIX}.lora_A")}
    trained = [(name, param) for name, param in meta.named_parameters(remove_duplicate=False)
               if param.requires_grad and not is_lora_tensor(name) and saved(name)]
    replaced = {base_key(name): take(name) for name, _ in trained}
    first_name: dict[int, str] = {}
    tied = {base_key(name): first_name[id(param)] for name, param in trained
            if first_name.setdefault(id(param), base_key(name)) != base_key(name)}
    replaced.update(image_side_replaced(config, tensors))
    linear = {}
    for key in tensors:
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            linear[module.removeprefix(PEFT_PREFIX) + ".weight"] = LoraDelta(
                tensors[key], tensors[f"{module}.lora_B.weight"], scale, tensors.get(f"{module}.lora_magnitude_vector"))
    lora_parts = (".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector")
    unknown = [key for key in tensors if not key.endswith(lora_parts)]
    if unknown:  # never a merge that leaves out what the adapter trained
        raise ModelLoadError(f"{adapter_dir}: the adapter has '{unknown[0]}', which is neither LoRA nor a module it "
                             "names in modules_to_save; the merge does not know where it goes")
    if not (linear or experts or replaced):
        raise ModelLoadError(f"{adapter_dir} holds no LoRA weights")
    return AdapterUpdates(linear, experts, replaced, tied)


def rounded_tower(cfg: Config, updates: AdapterUpdates) -> set[str]:
    """A vision-language checkpoint's tower weights that trained 4-bit under LoRA (full keys): merged into as the
    4-bit model computed them, as the decoder's are. The tower's other weights stay as stored."""
    from qlora_fsdp.loading.vision_encoder import checkpoint_config, quantized_names

    config = checkpoint_config(cfg)
    if cfg.quant.vision_tower != "auto" or not is_multimodal(config):
        return set()
    four_bit = {name + ".weight" for name in quantized_names(meta_full_model(config))}
    return {key for key in updates.linear if key in four_bit and "language_model" not in key}


def image_side_replaced(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A vision-language adapter's projector trained in full (its modules_to_save, named in the full model), taken
    out of `tensors` by the full model's key."""
    modules = [PEFT_PREFIX + name + "." for name in config.get("modules_to_save") or []]
    keys = [key for key in tensors if ".lora_" not in key and key.startswith(tuple(modules))]
    return {key.removeprefix(PEFT_PREFIX): tensors.pop(key) for key in keys}


def updated_linear(updates: AdapterUpdates, full_key: str, weight: torch.Tensor) -> torch.Tensor:
    """A base tensor as the merge writes it: plus its LoRA update, or replaced where it trained in full (a router)."""
    if full_key in updates.linear:
        weight = updates.linear.pop(full_key).merged(weight)
    if full_key in updates.replaced:
        weight = updates.replaced.pop(full_key)
    return weight


class ExpertRounding:
    """Experts as training held them: each expert's matrix rounded through 4-bit as a whole (unless the merge is
    into the original weights), plus its LoRA update if it had one; written in the checkpoint's own layout."""

    def __init__(self, matrices: dict[str, ExpertMatrix], deltas: dict[str, ExpertDelta], rounding: bool) -> None:
        self.matrices, self.deltas, self.rounding = matrices, deltas, rounding
        self.merged: set[str] = set()  # full keys whose LoRA update was added

    def finished(self, piece: Experts, expert: int) -> torch.Tensor:
        """One expert's whole matrix as merged: rounded as trained, its update added."""
        weight, matrix = piece.read(expert), self.matrices[piece.key]
        if self.rounding:
            weight = matrix.dequantize(matrix.to_row(weight))
        delta = self.deltas.get(piece.full_key)
        if delta is None:
            return weight
        self.merged.add(piece.full_key)
        return delta.merged(expert, weight).to(weight.dtype)

    def written(self, piece: Experts) -> list[tuple[str, torch.Tensor]]:
        """(stored key, tensor): all experts stacked under one key, or one expert split into its stored parts."""
        if not piece.parts:
            return [(piece.stored_key, torch.stack([self.finished(piece, e) for e in piece.experts]))]
        (expert,) = piece.experts
        rows = self.finished(piece, expert).split([n_rows for _, n_rows in piece.parts])
        return [(name, part) for (name, _), part in zip(piece.parts, rows, strict=True)]


class ShardWriter:
    """Safetensors shards of at most `max_bytes`, then Hugging Face's names and index."""

    def __init__(self, out_dir: Path, max_bytes: int) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes, self.total_bytes = 0, 0
        self.files: list[tuple[Path, list[str]]] = []

    def add(self, key: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[key] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        path = self.out_dir / f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, path, metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> int:
        if self.pending:
            self.flush()
        if len(self.files) == 1:
            self.files[0][0].rename(self.out_dir / "model.safetensors")
            return 1
        weight_map = {}
        for index, (path, keys) in enumerate(self.files, start=1):
            name = f"model-{index:05d}-of-{len(self.files):05d}.safetensors"
            path.rename(self.out_dir / name)
            weight_map.update(dict.fromkeys(keys, name))
        index_json = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
        return len(self.files)


def meta_model_to_merge_into(cfg: Config, base_weights: Literal["dequantized", "original"]) -> nn.Module:
    """The model the adapter was trained on, built on the meta device; refused where it has no weights to merge
    into (random ones, or original ones of a pre-quantized checkpoint)."""
    if cfg.model.init == "random":
        raise ModelLoadError("model.init is random: there are no base weights to merge into")
    hf_config = load_hf_config(cfg)
    if base_weights == "original" and quant_method(hf_config) == "bitsandbytes":
        raise ConfigError(f"{cfg.model.path} stores its weights in 4-bit: it has no original weights to merge into; "
                          "leave --base-weights at dequantized")
    return build_meta_model(cfg, hf_config)


def merge_adapter(cfg: Config, adapter_dir: Path, out_dir: Path, dtype: DType = "bfloat16",
                  max_shard_bytes: int = 2 * 10**9, base_weights: Literal["dequantized", "original"] = "dequantized",
                  device: str = "cpu") -> int:
    """Write base + adapter to `out_dir` (which must not exist); returns the number of shards."""
    cfg = describe_run(cfg, describe_device(torch.device(device))).cfg  # `auto` as on the device that merges
    meta = meta_model_to_merge_into(cfg, base_weights)
    updates = adapter_updates(adapter_dir, meta)
    targets = base_targets(meta)
    experts = ExpertRounding({key: t.experts for key, t in targets.items() if t.experts is not None},
                             updates.experts, rounding=base_weights == "dequantized")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer = ShardWriter(tmp, max_shard_bytes)
    shapes = model_shapes(targets, cfg)
    tower = rounded_tower(cfg, updates)
    reader = CheckpointReader(model_dir(cfg), model_layout(meta), shapes, torch.device(device),
                              cfg.model.allow_pickle)
    for piece in reader.pieces():
        for key, tensor in merged_tensors(piece, updates, experts, set(shapes.four_bit) | tower, cfg, device):
            writer.add(key, tensor.to(device="cpu", dtype=TORCH_DTYPES[dtype]))
    for key in experts.merged:
        updates.experts.pop(key)
    if updates.unused() is not None:
        raise ModelLoadError(f"the adapter has '{updates.unused()}', which the base checkpoint lacks: another base?")
    shards = writer.finish()
    write_plain_config(cfg, tmp, dtype)
    copy_tokenizer(adapter_dir, model_dir(cfg), tmp)
    if out_dir.exists():  # the caller allowed replacing it; removed only now that the new one is complete
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return shards


def merged_tensors(piece: Piece, updates: AdapterUpdates, experts: ExpertRounding, quantized: set[str],
                   cfg: Config, device: str) -> list[tuple[str, torch.Tensor]]:
    """(stored key, tensor as merged) for one piece of the base checkpoint."""
    if isinstance(piece, Experts):
        return experts.written(piece)
    if isinstance(piece, FourBit):  # as trained: the stored 4-bit values, dequantized
        return [(piece.stored_key, updated_linear(updates, piece.full_key, piece.dequantized()))]
    stored = piece.tensor.read().to(device=device)
    weight = stored.to(TORCH_DTYPES[cfg.model.dtype])
    if experts.rounding and (piece.key in quantized or piece.full_key in quantized):
        if initialized(cfg) and piece.full_key in updates.linear:  # the residual the loader quantized instead
            delta = updates.linear.pop(piece.full_key)
            residual, trained = initialized_base(stored, delta, cfg)
            return [(piece.stored_key, trained.merged(as_trained(residual.to(weight.dtype), cfg.quant)))]
        weight = as_trained(weight, cfg.quant)
    return [(piece.stored_key, updated_linear(updates, piece.full_key, weight))]


def initialized_base(stored: torch.Tensor, delta: LoraDelta, cfg: Config) -> tuple[torch.Tensor, LoraDelta]:
    """A PiSSA/OLoRA/LoftQ run's base as its loader made it, from the original weight, and the trained update. The
    saved rank-2r adapter holds the trained A, B and then the start's A0, -B0: the residual is W - s B0 A0, exactly
    as the loader took it; LoftQ's (a quantized residual of its earlier alternations) is computed again."""
    r = delta.a.shape[0] // 2
    trained = LoraDelta(delta.a[:r], delta.b[:, :r], delta.scale, None)
    if cfg.lora.init == "loftq":
        start = initial_adapter("loftq", stored, r, delta.scale, TORCH_DTYPES[cfg.lora.dtype], 0, cfg.lora.loftq_iter,
                                round_trip(cfg.quant, TORCH_DTYPES[cfg.model.dtype]))
        return start.base, trained
    a0, b0 = delta.a[r:].to(stored.device).float(), -delta.b[:, r:].to(stored.device).float()
    return stored.float() - delta.scale * (b0 @ a0), trained


def write_plain_config(cfg: Config, out_dir: Path, dtype: DType) -> None:
    """The checkpoint's own config (a multimodal one keeps its vision tower, copied as is), in `dtype` and no longer
    quantized; its vocabulary grown where training added tokens (model.add_tokens)."""
    config = AutoConfig.from_pretrained(model_dir(cfg), trust_remote_code=cfg.model.trust_remote_code)
    config.dtype = dtype
    config.__dict__.pop("quantization_config", None)
    if cfg.model.add_tokens:
        text_config(config).vocab_size = load_hf_config(cfg).vocab_size
    config.save_pretrained(out_dir)


def copy_tokenizer(adapter_dir: Path, base_dir: Path, out_dir: Path) -> None:
    """The tokenizer saved with the adapter (the one training used), so the folder is complete; and the base's
    sentencepiece model (tokenizer.model: Gemma, Llama 2, Mistral v0.1), which transformers 5 does not save back
    but llama.cpp's converter reads for those families (without it, it takes its BPE path and refuses the tokenizer).
    """
    for path in adapter_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")) or path.suffix == ".model":
            shutil.copy(path, out_dir / path.name)
    for path in base_dir.glob("*.model"):
        if not (out_dir / path.name).exists():
            shutil.copy(path, out_dir / path.name)


def parse_size(text: str) -> int:
    """'5GB' -> bytes (also MB, KB, GiB, MiB, KiB, or a plain number of bytes)."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    unit = next((u for u in units if upper.endswith(u)), "B")
    number, factor = upper.removesuffix(unit).strip(), units[unit]
    try:
        return int(float(number) * factor)
    except ValueError:
        raise ConfigError(f"size '{text}' is not like 5GB, 500MB or 2GiB") from None
