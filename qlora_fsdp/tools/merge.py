"""Merge a LoRA adapter into its base, one tensor at a time, into a plain Hugging Face checkpoint.

By default every weight that training held in 4-bit is quantized and dequantized exactly as the loader did,
so the merged model computes what base + adapter computed during training (the adapter learned to work
with the quantization error). `base_weights="original"` adds the adapter to the unquantized weights instead.
Host RAM stays near one output shard plus one weight: nothing holds the whole model.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import bitsandbytes.functional as bnbf
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig

from qlora_fsdp.config import Config, DType
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.errors import ConfigError, ModelLoadError
from qlora_fsdp.families import quant_method
from qlora_fsdp.layers.expert_lora import expert_loras
from qlora_fsdp.layers.experts4bit import LORA_SUFFIX, ExpertMatrix
from qlora_fsdp.loading.adapter import adapter_file_key, read_adapter
from qlora_fsdp.loading.build import build_meta_model
from qlora_fsdp.loading.checkpoint import load_hf_config, model_dir
from qlora_fsdp.loading.fill import base_targets, model_layout, quantize
from qlora_fsdp.loading.layout import ExpertPart, PartsWaiting
from qlora_fsdp.loading.names import PEFT_PREFIX, is_lora_tensor, weight_key
from qlora_fsdp.loading.stored_forms import (
    MXFP4_PARTS,
    StoredStatistics,
    bnb_4bit_part,
    is_packed_shape,
    mxfp4_experts,
    mxfp4_part,
)
from qlora_fsdp.loading.weight_files import stored_weight_tensors
from qlora_fsdp.precision import describe_device, resolve_dtypes


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
        return combined * (self.magnitude.to(weight.device).float() / combined.norm(dim=1)).unsqueeze(1)


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
        r = self.a.shape[0] // self.n_experts
        a = self.a.unflatten(0, (self.n_experts, r))[expert].to(weight.device).float()
        b = self.b.unflatten(1, (r, self.n_experts))[:, :, expert].to(weight.device).float()
        delta = self.scale * (b @ a)  # [out, in]
        return weight.float() + (delta.t() if self.transposed else delta)


@dataclass
class AdapterUpdates:
    """What an adapter changes, by base checkpoint key: LoRA on linear weights, LoRA on fused experts, and the
    tensors it trained in full (routers: PEFT's modules_to_save)."""

    linear: dict[str, LoraDelta]
    experts: dict[str, ExpertDelta]
    replaced: dict[str, torch.Tensor]

    def unused(self) -> str | None:
        return next(iter([*self.linear, *self.experts, *self.replaced]), None)


def adapter_updates(adapter_dir: Path, meta: nn.Module) -> AdapterUpdates:
    """A PEFT adapter folder read as updates of the base checkpoint's keys (`...q_proj.weight`); `meta` is the model
    the adapter was trained on, which says which tensors are experts' LoRA and which trained in full."""
    config, tensors = read_adapter(adapter_dir)
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ModelLoadError("adapters with per-module rank_pattern/alpha_pattern are not supported by the merge")
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
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
    replaced = {base_key(name): take(name) for name, param in meta.named_parameters()
                if param.requires_grad and not is_lora_tensor(name) and saved(name)}
    linear = {}
    for key in tensors:
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            linear[module.removeprefix(PEFT_PREFIX) + ".weight"] = LoraDelta(
                tensors[key], tensors[f"{module}.lora_B.weight"], scale, tensors.get(f"{module}.lora_magnitude_vector"))
    if not (linear or experts or replaced):
        raise ModelLoadError(f"{adapter_dir} holds no LoRA weights")
    return AdapterUpdates(linear, experts, replaced)


def updated_linear(updates: AdapterUpdates, full_key: str, weight: torch.Tensor, dtype: DType) -> torch.Tensor:
    """A base tensor as the merge writes it: plus its LoRA update, or replaced where it trained in full (a router)."""
    if full_key in updates.linear:
        weight = updates.linear.pop(full_key).merged(weight)
    if full_key in updates.replaced:
        weight = updates.replaced.pop(full_key)
    return weight.to(device="cpu", dtype=TORCH_DTYPES[dtype])


class StoredFourBit:
    """A pre-quantized checkpoint's 4-bit weights, dequantized once their packed bytes and all their statistics
    have come (a file stores them by dtype, far apart)."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        self.device = torch.device(device)
        self.statistics = StoredStatistics(dtype)  # dequantized to model.dtype, as training does
        self.packed: dict[str, torch.Tensor] = {}
        self.states: dict[str, bnbf.QuantState] = {}

    def add(self, key: str, statistic: tuple[str, str] | None,
            tensor: torch.Tensor) -> tuple[str, torch.Tensor | None]:
        """(the weight's key, the dequantized weight once complete, else None)."""
        if statistic is None:
            self.packed[key] = tensor.contiguous().view(torch.uint8).reshape(-1, 1)
        else:
            key, name = statistic
            state = self.statistics.add(key, name, tensor, self.device)
            if state is not None:
                self.states[key] = state.state
        if key not in self.packed or key not in self.states:
            return key, None
        return key, bnbf.dequantize_4bit(self.packed.pop(key), self.states.pop(key))

    def check_complete(self) -> None:
        waiting = self.statistics.incomplete() or next(iter([*self.packed, *self.states]), None)
        if waiting is not None:
            raise ModelLoadError(f"checkpoint holds only part of the 4-bit weight '{waiting}' (its packed bytes and "
                                 "statistics): damaged or incomplete download?")


def as_trained(weight: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The weight the 4-bit model computed with: quantized as the loader does, then dequantized."""
    packed, state = quantize(weight, cfg.quant)
    return bnbf.dequantize_4bit(packed, state)


class ExpertRounding:
    """Experts as training held them: each expert's matrix rounded through 4-bit as a whole (unless the merge is
    into the original weights), plus its LoRA update if it had one. A checkpoint that keeps an expert's gate and up
    projections apart waits for both before either is written."""

    def __init__(self, matrices: dict[str, ExpertMatrix], deltas: dict[str, ExpertDelta], rounding: bool) -> None:
        self.matrices, self.deltas, self.rounding = matrices, deltas, rounding
        self.waiting = PartsWaiting()  # (key, expert) -> (stored key, tensor) of each part of an expert's matrix
        self.mxfp4 = PartsWaiting()  # key -> its MXFP4 blocks and scales
        self.merged: set[str] = set()  # keys whose LoRA update was added

    def finished(self, key: str, expert: int, weight: torch.Tensor) -> torch.Tensor:
        """One expert's whole matrix as merged: rounded as trained, its update added."""
        matrix = self.matrices[key]
        if self.rounding:
            weight = matrix.dequantize(matrix.to_row(weight))
        delta = self.deltas.get(key)
        if delta is None:
            return weight
        self.merged.add(key)
        return delta.merged(expert, weight).to(weight.dtype)

    def all_experts(self, key: str, experts: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.finished(key, index, expert) for index, expert in enumerate(experts)])

    def decoded_mxfp4(self, part: tuple[str, str], stored: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """MXFP4 experts (gpt-oss): once blocks and scales have both come, the decoded experts under the
        parameter's own name, merged."""
        name, which = part
        parts = self.mxfp4.add(name, MXFP4_PARTS.index(which), stored, len(MXFP4_PARTS))
        if parts is None:
            return []
        blocks, scales = parts
        return [(name, self.all_experts(name, mxfp4_experts(blocks, scales, self.matrices[name].dtype)))]

    def ready(self, stored_key: str, key: str, part: ExpertPart | None,
              weight: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(stored key, merged tensor) for what is complete now: a fused tensor at once, an expert's parts once
        all have come."""
        if part is None:
            return [(stored_key, self.all_experts(key, weight))]
        pieces = self.waiting.add((key, part.expert), part.part, (stored_key, weight), part.n_parts)
        if pieces is None:
            return []
        whole = self.finished(key, part.expert, torch.cat([tensor for _, tensor in pieces]))
        rows = whole.split([tensor.shape[0] for _, tensor in pieces])
        return [(name, part_rows) for (name, _), part_rows in zip(pieces, rows, strict=True)]


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
    cfg = resolve_dtypes(cfg, describe_device(torch.device(device)))  # `auto` as on the device that merges
    meta = meta_model_to_merge_into(cfg, base_weights)
    updates = adapter_updates(adapter_dir, meta)
    layout = model_layout(meta)  # the adapter's and the checkpoint's keys both name the checkpoint's full model
    targets = {layout.full_from_ours(key): target for key, target in base_targets(meta).items()}
    quantized = {key for key, target in targets.items() if target.quantized_module is not None}
    experts = ExpertRounding({key: t.experts for key, t in targets.items() if t.experts is not None},
                             updates.experts, rounding=base_weights == "dequantized")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer = ShardWriter(tmp, max_shard_bytes)
    stored_4bit = StoredFourBit(device, TORCH_DTYPES[cfg.model.dtype])
    for key, stored, _ in stored_weight_tensors(model_dir(cfg.model.path), cfg.model.allow_pickle):
        if key.endswith("rotary_emb.inv_freq"):
            continue
        statistic = bnb_4bit_part(key)
        if statistic is not None or (layout.full_key(key)[0] in quantized and is_packed_shape(stored.shape)):
            key, ready = stored_4bit.add(key, statistic, stored.read().to(device))
            if ready is not None:  # as trained: the stored 4-bit values, dequantized
                writer.add(key, updated_linear(updates, layout.full_key(key)[0], ready, dtype))
            continue
        full_key, part = layout.full_key(key)
        mxfp4 = mxfp4_part(full_key)
        if mxfp4 is not None and mxfp4[0] in experts.matrices:  # written as the unquantized model holds it
            for ready_key, ready in experts.decoded_mxfp4(mxfp4, stored.read().to(device)):
                writer.add(ready_key, ready.to(device="cpu", dtype=TORCH_DTYPES[dtype]))
            continue
        weight = stored.read().to(device=device, dtype=TORCH_DTYPES[cfg.model.dtype])
        if full_key in experts.matrices:
            for ready_key, ready in experts.ready(key, full_key, part, weight):
                writer.add(ready_key, ready.to(device="cpu", dtype=TORCH_DTYPES[dtype]))
            continue
        if full_key in quantized and base_weights == "dequantized":
            weight = as_trained(weight, cfg)
        writer.add(key, updated_linear(updates, full_key, weight, dtype))
    stored_4bit.check_complete()
    for key in experts.merged:
        updates.experts.pop(key)
    if updates.unused() is not None:
        raise ModelLoadError(f"the adapter has '{updates.unused()}', which the base checkpoint lacks: another base?")
    shards = writer.finish()
    write_plain_config(cfg, tmp, dtype)
    copy_tokenizer(adapter_dir, model_dir(cfg.model.path), tmp)
    if out_dir.exists():  # the caller allowed replacing it; removed only now that the new one is complete
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return shards


def write_plain_config(cfg: Config, out_dir: Path, dtype: DType) -> None:
    """The checkpoint's own config (a multimodal one keeps its vision tower, copied as is), in `dtype` and no longer
    quantized."""
    config = AutoConfig.from_pretrained(model_dir(cfg.model.path), trust_remote_code=cfg.model.trust_remote_code)
    config.dtype = dtype
    config.__dict__.pop("quantization_config", None)
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
