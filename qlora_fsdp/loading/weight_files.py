"""Find a checkpoint's weight files and read its tensors one at a time, or just the rows a rank keeps.

Safetensors files are read by the library (`safe_open`), memory-mapped: a tensor, or a range of its rows, is a
view of the mapped file, so a bf16 checkpoint read for a bf16 model costs page cache (shared between ranks,
dropped by the kernel at will) and no anonymous memory. The mapped pages a rank touches count in its RSS until
the file is closed; `benchmarks/loading.py` measures both (docs/benchmarks/loading-and-merge.md, "Loading").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError, safe_open

from qlora_fsdp.errors import ModelLoadError

Backend = Literal["mmap", "pread"]  # pread: the library reads into fresh buffers (the benchmark's comparison)


class StoredTensor:
    """A tensor not read yet: its shape, and a way to read all of it or a range of its rows."""

    shape: tuple[int, ...]

    def read(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        raise NotImplementedError


class InMemoryTensor(StoredTensor):
    """A tensor already produced (random init, or an allowed pickle mapped by torch.load)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.shape = tuple(tensor.shape)

    def read(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self.tensor if rows is None else self.tensor[rows[0] : rows[1]]


@dataclass
class SafetensorsTensor(StoredTensor):
    """One tensor of an open safetensors file; what it reads stays valid after the file is closed."""

    file: Path
    handle: safe_open
    name: str
    shape: tuple[int, ...]

    def read(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        with library_errors(self.file):
            if rows is None or rows[0] >= rows[1]:
                # the library refuses an empty slice at the end of a dimension ([n:n]); a whole mapped tensor
                # is a view (no read), and empty ranges only occur for tensors with fewer rows than world_size**2
                whole = self.handle.get_tensor(self.name)
                return whole if rows is None else whole[rows[0] : rows[1]]
            return self.handle.get_slice(self.name)[rows[0] : rows[1]]


@contextmanager
def library_errors(file: Path) -> Iterator[None]:
    """The library's error as the loader's: one line that names the file."""
    try:
        yield
    except SafetensorError as err:
        reason = " ".join(str(err).split())  # one line, whatever the library wrote
        raise ModelLoadError(f"{file} is not a readable safetensors file ({reason}): damaged or truncated?") from None


def safetensors_tensors(file: Path, backend: Backend) -> Iterator[tuple[str, StoredTensor, str]]:
    """The file's tensors in file order, so reads go forward; the file stays open until the last is yielded."""
    with library_errors(file):
        handle = safe_open(file, framework="pt", backend=backend)
    with handle:
        for key in handle.offset_keys():
            yield key, SafetensorsTensor(file, handle, key, tuple(handle.get_slice(key).get_shape())), file.name


def weight_files(path: Path, allow_pickle: bool = False) -> list[Path]:
    """The checkpoint's safetensors shards (from the index where there is one); pickle only if allowed."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shard {missing[0]}, which is missing from {path}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))
    if pickles and allow_pickle:
        return pickles
    if pickles:
        raise ModelLoadError(f"{path} has only pickle weights (.bin/.pt), which can run code when loaded; convert "
                             "them to safetensors, or set model.allow_pickle=true if you trust their source")
    raise ModelLoadError(f"{path} has no weights (*.safetensors); for an architecture-only run set model.init=random")


def stored_keys(path: Path) -> list[str]:
    """Every stored tensor's key, from the index or the files' headers (no tensor is read); pickles: none."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    keys: list[str] = []
    for file in sorted(path.glob("*.safetensors")):
        with library_errors(file), safe_open(file, framework="pt") as handle:
            keys.extend(handle.keys())
    return keys


def stored_weight_tensors(path: Path, allow_pickle: bool, backend: Backend = "mmap"
                       ) -> Iterator[tuple[str, StoredTensor, str]]:
    """(key, tensor not yet read, file name), one file open at a time."""
    for file in weight_files(path, allow_pickle):
        if file.suffix == ".safetensors":
            yield from safetensors_tensors(file, backend)
        else:  # allowed pickle: tensors only (no code), memory-mapped so the file is not read whole
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            for key in list(state):
                yield key, InMemoryTensor(state.pop(key)), file.name
