"""DPO's reference log-probabilities computed once, before the first step, and kept with the run.

The other way to get them (preference.reference: adapter_off) runs the base with the adapter turned off on every
micro-batch: one more forward a step. Computed ahead, that forward is paid once per pair instead of once per visit:
cheaper from the first full epoch on, dearer for a run that sees part of the data. A resumed run reads the file;
one computed for other data or another base model is refused in one line. A run that starts from a saved adapter
(model.adapter) compares against that adapter: its reference is the model as it stands before the first step, so
it can only be computed then.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import datasets
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from qlora_fsdp.config import Config
from qlora_fsdp.data.batching import collate_packed, pack
from qlora_fsdp.data.pipeline import TokenizedData
from qlora_fsdp.distributed import DistInfo
from qlora_fsdp.distributed.row_groups import RowSplit
from qlora_fsdp.errors import DataError
from qlora_fsdp.loading.checkpoint import model_dir
from qlora_fsdp.loading.weight_files import weight_files
from qlora_fsdp.losses.pair_losses import PairLoss
from qlora_fsdp.objectives.pair_steps import held_out_batches, idle_forwards
from qlora_fsdp.objectives.row_shards import row_part
from qlora_fsdp.outputs.checkpoints import TMP_PREFIX, sync_dir

REFERENCE_FILE = "reference_logps.safetensors"


def fingerprint(cfg: Config, data: TokenizedData) -> str:
    """What the reference log-probabilities depend on: the tokenized pairs (datasets' fingerprints of both splits),
    the base model (its name, config.json, its weight files' names and sizes), how it is quantized and run."""
    folder = model_dir(cfg)  # a hub id's too: its fetched files are what the log-probabilities came from
    weights = [(f.name, f.stat().st_size) for f in weight_files(folder)] if cfg.model.init != "random" else []
    config_text = (folder / "config.json").read_text()
    adapter = Path(cfg.model.adapter) if cfg.model.adapter else None
    adapter_parts = [str(adapter), (adapter / "adapter_config.json").read_text(),
                     (adapter / "adapter_model.safetensors").stat().st_size] if adapter else []
    parts = [data.train._fingerprint, data.eval._fingerprint, cfg.model.path, config_text, weights, adapter_parts,
             repr(cfg.quant), cfg.model.dtype, cfg.quant.compute_dtype]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def train_batches(split: datasets.Dataset, cfg: Config, rows_split: RowSplit) -> tuple[list[list[list[int]]], int]:
    """This rank's forwards over the training pairs (each a list of rows, each row its pairs: packed as training
    packs them, or a pair a row; micro_batch rows a forward), and how many forwards the busiest rank runs. The
    ranks sharing rows (context parallel) take the same pairs, each its part of them."""
    rows = pack(split["length"], cfg.data.context_length) if cfg.data.packing else [[i] for i in range(len(split))]
    mine, per_forward = rows[rows_split.data_rank :: rows_split.data_ranks], max(1, cfg.data.micro_batch)
    n_forwards = math.ceil(math.ceil(len(rows) / rows_split.data_ranks) / per_forward)
    return [mine[i : i + per_forward] for i in range(0, len(mine), per_forward)], n_forwards


def eval_batches(data: TokenizedData, cfg: Config, rows_split: RowSplit) -> tuple[list[list[list[int]]], int]:
    """The held-out pairs as evaluation batches them (a pair a row), so the start's rewards tie to the bit."""
    chunks, n_batches = held_out_batches(data.samples(data.eval, list(range(len(data.eval)))),
                                         cfg.data.eval_batch_size, rows_split)
    return [[[pair] for pair in chunk] for chunk in chunks], n_batches


@torch.no_grad()
def split_reference(model: nn.Module, data: TokenizedData, split: datasets.Dataset, cfg: Config, pair_loss: PairLoss,
                    pad_id: int, info: DistInfo, rows_split: RowSplit) -> torch.Tensor:
    """(pairs, 2): each pair's chosen and rejected log-probability under the reference, in the batches training
    (or evaluation, for the held-out pairs) runs; ranks share them."""
    table = torch.zeros(len(split), 2, dtype=torch.float32, device=info.device)
    forwards, n_forwards = (eval_batches(data, cfg, rows_split) if split is data.eval
                            else train_batches(split, cfg, rows_split))
    was_training = model.training
    model.eval()
    for index in range(n_forwards):
        if index >= len(forwards):  # keep the collectives in step with ranks that still have pairs
            idle_forwards(model, pair_loss, pad_id, info.device, rows_split)
            continue
        rows = forwards[index]
        batch = row_part(collate_packed([data.samples(split, row) for row in rows], pad_id), rows_split, pad_id)
        ids = [pair for row in rows for pair in row]
        logps = pair_loss.reference_logps(model, batch, info.device, adapter_is_reference=bool(cfg.model.adapter))
        if batch.counts_once():  # a split row's ranks each hold its whole sums
            table[ids] = logps.view(-1, 2).float()
    model.train(was_training)
    if dist.is_initialized() and info.world_size > 1:
        dist.all_reduce(table)  # each pair's row was filled by one rank, zeros elsewhere
    return table.cpu()


def reference_logps(cfg: Config, model: nn.Module, data: TokenizedData, pair_loss: PairLoss, pad_id: int,
                    info: DistInfo, out_dir: Path, step: int,
                    rows_split: RowSplit | None = None) -> dict[str, torch.Tensor]:
    """{"train": (pairs, 2), "eval": (pairs, 2)}: read from the run folder when it holds them for this data and base
    model, else computed (every rank) and written by rank 0. `step`: where the run starts (a resumed run's)."""
    path, expected = out_dir / REFERENCE_FILE, fingerprint(cfg, data)
    if path.is_file():
        with safe_open(path, "pt") as handle:
            found = (handle.metadata() or {}).get("fingerprint")
        if found != expected:
            raise DataError(f"{path} holds reference log-probabilities of other data or another base model; "
                            "delete it to compute them again (or resume with the data and model it was made with)")
        return load_file(path)
    if cfg.model.adapter and step > 0:
        raise DataError(f"{path} is missing: a run that starts from model.adapter compares against that adapter as "
                        "it was before the first step, which a resumed run no longer has; start the run again")
    rows_split = rows_split or RowSplit(1, 0, info.rank, info.world_size)
    tables = {name: split_reference(model, data, split, cfg, pair_loss, pad_id, info, rows_split)
              for name, split in (("train", data.train), ("eval", data.eval))}
    if info.is_main:
        write_whole(tables, path, expected)
    return tables


def write_whole(tables: dict[str, torch.Tensor], path: Path, fingerprint_: str) -> None:
    """Written beside and renamed, so a kill mid-write leaves no truncated file for the resume to trip on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{TMP_PREFIX}{path.name}")
    save_file(tables, partial, metadata={"fingerprint": fingerprint_})
    with partial.open("rb") as written:
        os.fsync(written.fileno())
    os.replace(partial, path)
    sync_dir(path.parent)
