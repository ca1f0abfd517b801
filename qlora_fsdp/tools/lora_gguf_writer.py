"""Run by llama.cpp's converter's Python (its folder first on PYTHONPATH, never imported by the package): LoRA pairs
named as the base checkpoint names its weights, written as llama.cpp's LoRA GGUF.

    python lora_gguf_writer.py BASE_FOLDER PAIRS.safetensors ALPHA OUTTYPE OUT.gguf

The converter's own model class for the base's architecture names each tensor as the base's GGUF does and reorders
rows where the converter does (Llama's q and k rows are permuted for llama.cpp's rope). A LoRA update B A changes
by such a reordering only through B's rows, so the class's `modify_tensors` is applied to a probe of row numbers:
what comes out says which rows of B each GGUF tensor takes. A class that does anything else to a tensor (scales it,
transposes it, mixes rows) is refused: B A would need a full-size matrix, which a LoRA file cannot hold.

The file holds `<name>.lora_a` (r x in) and `<name>.lora_b` (out x r) per weight, general.type "adapter",
adapter.type "lora" and adapter.lora.alpha, from which llama.cpp scales each update by alpha / r. On failure: one
line "ERROR: ..." on stderr and exit status 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf  # the converter's own
import torch
from conversion import ModelBase, get_model_class
from safetensors.torch import load_file

FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}
NUMPY_TYPES = {"f32": "float32", "f16": "float16"}


def block_id(name: str) -> int | None:
    """The layer number in a checkpoint name (model.layers.3.mlp.up_proj.weight -> 3), as the converter finds it."""
    return next((int(part) for part in name.split(".") if part.isdecimal()), None)


def only_reordered(probe_out: torch.Tensor, n_rows: int) -> bool:
    """The probe came back as whole rows of it: row numbers in the first column, their pair in the second."""
    numbers = probe_out[:, 0]
    return bool(torch.equal(numbers, numbers.round()) and torch.equal(probe_out[:, 1], -numbers - 1)
                and numbers.min() >= 0 and numbers.max() < n_rows)


def row_maps(model: ModelBase, name: str, n_rows: int) -> list[tuple[str, torch.Tensor]]:
    """Each GGUF tensor the converter makes of the checkpoint's `name`, with the rows of the original it holds."""
    probe = torch.arange(n_rows, dtype=torch.float32)
    probe = torch.stack([probe, -probe - 1], dim=1)  # a second column: the class must treat columns alike
    mapped = []
    for gguf_name, rows in model.modify_tensors(probe, name, block_id(name)):
        rows = torch.as_tensor(rows, dtype=torch.float32)
        if not (rows.dim() == 2 and rows.shape[1] == 2 and only_reordered(rows, n_rows)):
            raise ValueError(f"the converter's {type(model).__name__} changes {name} otherwise than by reordering "
                             "its rows; a LoRA GGUF cannot carry it: export the merged model instead")
        mapped.append((gguf_name, rows[:, 0].long()))
    if not mapped:  # a class that gathers tensors first (experts) would leave this update out
        raise ValueError(f"the converter's {type(model).__name__} writes nothing of {name} alone; a LoRA GGUF "
                         "cannot carry it: export the merged model instead")
    return mapped


def write(base: Path, pairs_file: Path, alpha: float, outtype: str, out: Path) -> int:
    hparams = ModelBase.load_hparams(base, False)
    model_class = get_model_class(hparams["architectures"][0])
    model = model_class(base, FILE_TYPES[outtype], out, eager=True, dry_run=True, hparams=hparams)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[model_class.model_arch])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    pairs = load_file(pairs_file)
    for name in sorted(key.removesuffix(".lora_a") for key in pairs if key.endswith(".lora_a")):
        lora_a, lora_b = pairs[f"{name}.lora_a"], pairs[f"{name}.lora_b"]
        for gguf_name, rows in row_maps(model, name, lora_b.shape[0]):
            writer.add_tensor(f"{gguf_name}.lora_a", lora_a.numpy().astype(NUMPY_TYPES[outtype]))
            writer.add_tensor(f"{gguf_name}.lora_b", lora_b[rows].numpy().astype(NUMPY_TYPES[outtype]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return 0


if __name__ == "__main__":
    base_folder, pairs_path, alpha_text, file_type, out_file = sys.argv[1:]
    try:
        sys.exit(write(Path(base_folder), Path(pairs_path), float(alpha_text), file_type, Path(out_file)))
    except (ValueError, KeyError, NotImplementedError) as err:
        print(f"ERROR: {err}", file=sys.stderr)
        sys.exit(1)
