"""Find a checkpoint's weight files and read its tensors one at a time, or just the rows a rank keeps.

Safetensors files are read with plain reads into a fresh buffer, not memory-mapped: a mapped file's
touched pages count as the process's RSS until it is closed, which put a whole 350 MB shard file on
top of every rank's peak. A read leaves them in the shared page cache instead.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from qlora_fsdp.errors import ModelLoadError

SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100 * 2**20


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
class SafetensorsEntry(StoredTensor):
    """One tensor of a safetensors file: its dtype, shape and byte range (absolute file offsets)."""

    file: io.FileIO  # opened unbuffered: reads go straight into the tensor's memory
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    def read(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        n_rows = self.shape[0] if self.shape else 1  # a scalar is one row
        first, last = rows if rows is not None else (0, n_rows)
        row_bytes = (self.end - self.start) // max(n_rows, 1)
        buffer = torch.empty((last - first) * row_bytes, dtype=torch.uint8)
        self.file.seek(self.start + first * row_bytes)
        # ignore: numpy's stubs give ndarray the buffer protocol (__buffer__) only for Python 3.12+
        if self.file.readinto(memoryview(buffer.numpy())) != buffer.numel():  # type: ignore[arg-type]
            raise ModelLoadError(f"{self.file.name} ends early: the file is truncated")
        shape = (last - first, *self.shape[1:]) if self.shape else ()
        return buffer.view(self.dtype).reshape(shape)


@dataclass
class LibraryTensor(StoredTensor):
    """One tensor of an open safetensors file, read by the library (whole, or a range of rows)."""

    file: Path
    handle: safe_open
    name: str
    shape: tuple[int, ...]

    def read(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        with library_errors(self.file):
            if rows is None or rows[0] >= rows[1]:
                # safetensors refuses an empty slice at the end of a dimension ([n:n]); an empty range only
                # occurs for tensors with fewer rows than about world_size squared, so a whole read is cheap
                whole = self.handle.get_tensor(self.name)
                return whole if rows is None else whole[rows[0] : rows[1]]
            return self.handle.get_slice(self.name)[rows[0] : rows[1]]


@contextmanager
def library_errors(file: Path) -> Iterator[None]:
    """safetensors' own error, as the loader's one-line error that names the file."""
    try:
        yield
    except SafetensorError as err:
        reason = " ".join(str(err).split())  # one line, whatever the library wrote
        raise ModelLoadError(f"{file} is not a readable safetensors file ({reason}): damaged or truncated?") from None


def library_tensors(file: Path, backend: str) -> Iterator[tuple[str, StoredTensor, str]]:
    """The file's tensors in file order (reads go forward); the file stays open until the last is yielded."""
    with library_errors(file):
        handle = safe_open(file, framework="pt", backend=backend)
    with handle:
        for key in handle.offset_keys():
            yield key, LibraryTensor(file, handle, key, tuple(handle.get_slice(key).get_shape())), file.name


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


def safetensors_entries(file: io.FileIO) -> dict[str, SafetensorsEntry]:
    """Parse the header (8-byte length, then JSON); entries in file order, so reads go forward."""
    size = Path(file.name).stat().st_size
    length = int.from_bytes(file.read(8), "little")
    if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
        raise ModelLoadError(f"{file.name} is not a safetensors file (bad header length)")
    try:
        header = json.loads(file.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ModelLoadError(f"{file.name} is not a safetensors file (unreadable header)") from None
    header.pop("__metadata__", None)
    entries = {name: entry_of(file, name, info, 8 + length, size) for name, info in header.items()}
    return dict(sorted(entries.items(), key=lambda item: item[1].start))


def entry_of(file: io.FileIO, name: str, info: dict[str, Any], data_start: int, size: int) -> SafetensorsEntry:
    dtype = SAFETENSORS_DTYPES.get(info.get("dtype", ""))  # a missing dtype is unsupported too
    if dtype is None:
        raise ModelLoadError(f"{file.name}: tensor '{name}' has unsupported dtype {info.get('dtype')}")
    shape = tuple(info["shape"])
    begin, end = info["data_offsets"]
    if end - begin != math.prod(shape) * dtype.itemsize or data_start + end > size:
        raise ModelLoadError(f"{file.name}: tensor '{name}' has a byte range that does not match its shape "
                             "or lies past the end of the file (truncated download?)")
    return SafetensorsEntry(file, dtype, shape, data_start + begin, data_start + end)


def checkpoint_tensors(path: Path, allow_pickle: bool, backend: str = "own"
                       ) -> Iterator[tuple[str, StoredTensor, str]]:
    """(key, tensor not yet read, file name), one file open at a time."""
    for file in weight_files(path, allow_pickle):
        if file.suffix == ".safetensors" and backend != "own":
            yield from library_tensors(file, backend)
        elif file.suffix == ".safetensors":
            with open(file, "rb", buffering=0) as handle:
                for key, entry in safetensors_entries(handle).items():
                    yield key, entry, file.name
        else:  # allowed pickle: tensors only (no code), memory-mapped so the file is not read whole
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            for key in list(state):
                yield key, InMemoryTensor(state.pop(key)), file.name
