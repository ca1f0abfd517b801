"""The one reader of a checkpoint's stored tensors, for loading (training, sampling) and merge alike.

What the checkpoint stores is decided once, before any tensor is read: the key list and config.json say which weights
are bitsandbytes 4-bit (packed bytes plus statistics), which experts come fused, one by one (Mixtral's w1/w3) or in
MXFP4 (gpt-oss). The reader then streams the files and hands out whole units, each in the model's own terms:

- `Plain`: a tensor as stored (bf16/fp32), not read yet: the caller reads the rows it keeps.
- `FourBit`: a pre-quantized 4-bit weight once its bytes and every statistic have come: its rebuilt quantization
  state and a reader of any range of its packed bytes (nothing dequantized or quantized again).
- `Experts`: a fused experts parameter, or one expert of it, with a reader of one expert's whole matrix as the
  model holds it (decoded from MXFP4, or its stored parts joined); an expert is read only when asked for, so a rank
  reads only the experts it keeps.

Parts that make a whole only together wait as unread handles (safetensors maps the file: holding one costs nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import bitsandbytes.functional as bnbf
import torch

from qlora_fsdp.config import QuantConfig
from qlora_fsdp.errors import ModelLoadError
from qlora_fsdp.layers.experts4bit import ExpertMatrix
from qlora_fsdp.loading.layout import CheckpointLayout, ExpertPart, PartsWaiting
from qlora_fsdp.loading.stored_forms import (
    MXFP4_PARTS,
    StoredStatistics,
    bnb_4bit_part,
    is_packed_shape,
    mxfp4_experts,
    mxfp4_part,
    packed_byte_rows,
    quantized_weight_keys,
)
from qlora_fsdp.loading.weight_files import StoredTensor, stored_keys, stored_weight_tensors


@dataclass(frozen=True)
class ModelShapes:
    """What the reader must know of the model it reads for (from its meta build): our keys of its 4-bit linears
    (out, in) and of its fused experts (count, one expert's matrix)."""

    four_bit: dict[str, tuple[int, int]]
    experts: dict[str, tuple[int, ExpertMatrix]]
    dtype: torch.dtype  # model.dtype: decoded experts and rebuilt 4-bit states give this
    quant: QuantConfig


@dataclass
class Plain:
    key: str | None  # our model's key; None for a tensor the text model does not hold (a vision tower)
    full_key: str  # the checkpoint's full model's name (what an adapter names)
    stored_key: str
    tensor: StoredTensor
    source: str


@dataclass
class FourBit:
    key: str | None
    full_key: str
    stored_key: str  # the weight's: its statistics are stored as `<stored_key>.absmax`, ...
    packed: StoredTensor  # the packed bytes, in whatever dtype transformers stored them
    state: bnbf.QuantState
    source: str

    @property
    def n_bytes(self) -> int:
        return self.state.shape.numel() // 2  # two 4-bit values a byte

    def bytes(self, first: int = 0, last: int | None = None) -> torch.Tensor:
        """Bytes [first, last) of the packed values as [n, 1] uint8, read from however many stored elements cover
        them (transformers may store them as bf16: two bytes an element)."""
        last = self.n_bytes if last is None else last
        itemsize, remainder = divmod(self.n_bytes, self.packed.shape[0])
        if remainder or itemsize not in (1, 2, 4) or not is_packed_shape(self.packed.shape):
            raise ModelLoadError(f"the 4-bit weight '{self.key or self.full_key}' is stored as "
                                 f"{tuple(self.packed.shape)}, where the config wants {self.n_bytes} packed bytes: "
                                 "config and weights disagree")
        rows = self.packed.read((first // itemsize, -(-last // itemsize)))
        return packed_byte_rows(rows, first, last - first)

    def dequantized(self) -> torch.Tensor:
        return bnbf.dequantize_4bit(self.bytes().to(self.state.absmax.device), self.state)


@dataclass
class Experts:
    key: str
    full_key: str
    experts: range  # the experts this piece holds
    read: Callable[[int], torch.Tensor]  # one expert's whole matrix, as the model holds it, in the model's dtype
    source: str
    # where each expert's matrix is stored: the stored key of each part and its rows (Mixtral's w1 then w3); empty
    # where one tensor holds all the experts, stored under `stored_key`
    parts: list[tuple[str, int]] = field(default_factory=list)
    stored_key: str = ""


Piece = Plain | FourBit | Experts


def stored_4bit_weights(folder: Path | None) -> set[str]:
    """The stored keys of the weights a checkpoint keeps in bitsandbytes 4-bit (headers only: nothing is read)."""
    if folder is None or not any(folder.glob("*.safetensors")):
        return set()
    return quantized_weight_keys(stored_keys(folder))


class CheckpointReader:
    """Streams a checkpoint folder as Plain, FourBit and Experts pieces (see the module's docstring)."""

    def __init__(self, folder: Path, layout: CheckpointLayout, shapes: ModelShapes, device: torch.device,
                 allow_pickle: bool = False) -> None:
        self.folder, self.layout, self.shapes, self.device = folder, layout, shapes, device
        self.allow_pickle = allow_pickle
        self.four_bit_stored = stored_4bit_weights(folder)  # decided before any tensor is read
        self.statistics = StoredStatistics(shapes.dtype)
        self.packed: dict[str, tuple[StoredTensor, str]] = {}  # 4-bit weights whose state has not come yet
        self.states: dict[str, bnbf.QuantState] = {}  # ... and whose bytes have not come yet
        self.expert_parts = PartsWaiting()  # (key, expert) -> (stored key, tensor) of each of its parts
        self.mxfp4 = PartsWaiting()  # our key -> its MXFP4 blocks and scales

    def pieces(self) -> Iterator[Piece]:
        for stored_key, tensor, source in stored_weight_tensors(self.folder, self.allow_pickle):
            if stored_key.endswith("rotary_emb.inv_freq"):  # older checkpoints saved this computed buffer
                continue
            yield from self.piece(stored_key, tensor, source)
        self.check_complete()

    def piece(self, stored_key: str, tensor: StoredTensor, source: str) -> Iterator[Piece]:
        statistic = bnb_4bit_part(stored_key)
        if statistic is not None:
            yield from self.four_bit(statistic[0], None, source, statistic[1], tensor)
            return
        full_key, part = self.layout.full_key(stored_key)
        key = self.layout.ours_from_full(full_key)
        if stored_key in self.four_bit_stored or (key in self.shapes.four_bit and is_packed_shape(tensor.shape)):
            yield from self.four_bit(stored_key, tensor, source)
        elif (found := mxfp4_part(full_key)) is not None and self.holds_experts(found[0]):
            yield from self.mxfp4_experts(found, tensor, source)
        elif key is not None and key in self.shapes.experts:
            yield from self.experts(key, full_key, stored_key, part, tensor, source)
        else:
            yield Plain(key, full_key, stored_key, tensor, source)

    def holds_experts(self, full_key: str) -> bool:
        return self.layout.ours_from_full(full_key) in self.shapes.experts

    def four_bit(self, stored_key: str, packed: StoredTensor | None, source: str, statistic: str = "",
                 tensor: StoredTensor | None = None) -> Iterator[FourBit]:
        """A 4-bit weight's packed bytes or one of its statistics; the weight once both are complete."""
        if packed is not None:
            self.packed[stored_key] = (packed, source)
        else:
            assert tensor is not None, "a statistic comes with its tensor"
            state = self.statistics.add(stored_key, statistic, tensor.read(), self.device)
            if state is None:
                return
            full_key, _ = self.layout.full_key(stored_key)
            key = self.layout.ours_from_full(full_key)
            if key in self.shapes.four_bit:
                state.check(key, self.shapes.four_bit[key], self.shapes.quant)
            self.states[stored_key] = state.state
        if stored_key in self.packed and stored_key in self.states:
            full_key, _ = self.layout.full_key(stored_key)
            packed_tensor, packed_source = self.packed.pop(stored_key)
            yield FourBit(self.layout.ours_from_full(full_key), full_key, stored_key, packed_tensor,
                          self.states.pop(stored_key), packed_source)

    def experts(self, key: str, full_key: str, stored_key: str, part: ExpertPart | None, stored: StoredTensor,
                source: str) -> Iterator[Experts]:
        n_experts, matrix = self.shapes.experts[key]
        if part is None:  # all experts in one tensor
            if tuple(stored.shape) != (n_experts, *matrix.shape):
                raise ModelLoadError(f"checkpoint experts of shape {tuple(stored.shape)} for '{key}', where the "
                                     f"config wants {(n_experts, *matrix.shape)}: config and weights disagree")
            yield Experts(key, full_key, range(n_experts), self.expert_reader(stored), source, stored_key=stored_key)
            return
        parts = self.expert_parts.add((key, part.expert), part.part, (stored_key, stored), part.n_parts)
        if parts is None:
            return

        def read(expert: int) -> torch.Tensor:
            weight = torch.cat([tensor.read() for _, tensor in parts]).to(device=self.device, dtype=self.shapes.dtype)
            if tuple(weight.shape) != matrix.shape:
                raise ModelLoadError(f"checkpoint expert {expert} of '{key}' has shape {tuple(weight.shape)} where "
                                     f"the config wants {matrix.shape}: config and weights disagree")
            return weight

        yield Experts(key, full_key, range(part.expert, part.expert + 1), read, source,
                      parts=[(name, tensor.shape[0]) for name, tensor in parts])

    def expert_reader(self, stored: StoredTensor) -> Callable[[int], torch.Tensor]:
        def read(expert: int) -> torch.Tensor:
            return stored.read((expert, expert + 1))[0].to(device=self.device, dtype=self.shapes.dtype)

        return read

    def mxfp4_experts(self, found: tuple[str, str], stored: StoredTensor, source: str) -> Iterator[Experts]:
        """An experts parameter stored in MXFP4 (gpt-oss), once both its blocks and its scales have come: each
        expert decoded on its own when read."""
        full_key, which = found
        key = self.layout.ours_from_full(full_key)
        assert key is not None, "the caller checked that the model holds these experts"
        parts = self.mxfp4.add(key, MXFP4_PARTS.index(which), stored, len(MXFP4_PARTS))
        if parts is None:
            return
        n_experts, matrix = self.shapes.experts[key]

        def read(expert: int) -> torch.Tensor:
            blocks, scales = (part.read((expert, expert + 1)).to(self.device) for part in parts)
            weight = mxfp4_experts(blocks, scales, self.shapes.dtype)[0]
            if tuple(weight.shape) != matrix.shape:
                raise ModelLoadError(f"MXFP4 experts of '{key}' decode to {tuple(weight.shape)} where the config "
                                     f"wants {matrix.shape}: config and weights disagree")
            return weight

        yield Experts(key, full_key, range(n_experts), read, source, stored_key=full_key)

    def check_complete(self) -> None:
        """After the last file: every whole got all its parts, or the checkpoint is damaged."""
        if (key := self.statistics.incomplete()) is not None:
            raise ModelLoadError(f"checkpoint holds only some of the statistics of the 4-bit weight '{key}': "
                                 "damaged or incomplete download?")
        if self.packed or self.states:
            key, has = (next(iter(self.packed)), "its packed bytes") if self.packed else \
                (next(iter(self.states)), "its statistics")
            raise ModelLoadError(f"checkpoint holds only {has} of the 4-bit weight '{key}': damaged or "
                                 "incomplete download?")
        if (name := self.mxfp4.incomplete()) is not None:
            raise ModelLoadError(f"checkpoint holds only one of the MXFP4 blocks and scales of '{name}': damaged or "
                                 "incomplete download?")
        if (waiting := self.expert_parts.incomplete()) is not None:
            key, expert = waiting
            raise ModelLoadError(f"checkpoint holds only part of expert {expert} of '{key}': config and weights "
                                 "disagree")
