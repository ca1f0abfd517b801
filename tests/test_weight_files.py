"""Safetensors read through the library behind the loader's interface: whole tensors and row ranges (a rank's
`torch.chunk`) equal the file's, reads outlive the closed file, damaged files fail in one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from qlora_fsdp.errors import ModelLoadError
from qlora_fsdp.loading.placement import chunk_rows
from qlora_fsdp.loading.weight_files import stored_weight_tensors

BACKENDS = ["mmap", "pread"]  # mmap: the loader's; pread: the benchmark's comparison


@pytest.fixture()
def stored(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "w.bf16": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        "w.f32": torch.randn(3, 2, 4, generator=generator),
        "ids.i64": torch.arange(11),
        "scale": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
    }
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


@pytest.mark.parametrize("backend", BACKENDS)
def test_reads_match_safetensors(stored, backend):
    reference = load_file(stored / "model.safetensors")
    read = {key: tensor.read() for key, tensor, _ in stored_weight_tensors(stored, allow_pickle=False, backend=backend)}
    # compared after the file was closed: a mapped tensor must keep its mapping alive
    assert read.keys() == reference.keys()
    for key, tensor in reference.items():
        assert read[key].dtype == tensor.dtype and torch.equal(read[key], tensor), key


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_ranges_are_torch_chunks(stored, backend):
    reference = load_file(stored / "model.safetensors")
    for key, tensor, _ in stored_weight_tensors(stored, allow_pickle=False, backend=backend):
        if not tensor.shape:
            continue
        for world in (1, 2, 3, 4):
            chunks = torch.chunk(reference[key], world, dim=0)
            for rank in range(world):
                expected = chunks[rank] if rank < len(chunks) else reference[key][:0]
                assert torch.equal(tensor.read(chunk_rows(tensor.shape[0], world, rank)), expected), (key, world)


def test_chunk_rows_matches_torch_chunk():
    for n_rows in range(0, 40):
        for world in range(1, 9):
            chunks = torch.arange(n_rows).chunk(world) if n_rows else ()
            for rank in range(world):
                first, last = chunk_rows(n_rows, world, rank)
                expected = chunks[rank].tolist() if rank < len(chunks) else []
                assert list(range(first, last)) == expected, (n_rows, world, rank)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_file_is_named(stored, damage, backend):
    path = stored / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-10] if damage == "truncated" else b"\x05" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors") as err:
        for _, tensor, _ in stored_weight_tensors(stored, allow_pickle=False, backend=backend):
            tensor.read()
    assert "\n" not in str(err.value)
