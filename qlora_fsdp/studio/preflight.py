"""What a launch from the page checks before it starts anything, in the command line's own words: the data's
local files read by the run's reader, the model a folder here or a hub id that answers, the ranks against the GPUs
this machine has. A run would find each of these only after its processes started (half a minute on a CPU)."""

from __future__ import annotations

import torch

from qlora_fsdp.config import Config
from qlora_fsdp.data.sources import eval_source, local_path, read_records, sources_of
from qlora_fsdp.errors import UserError
from qlora_fsdp.loading.checkpoint import check_model_path


def check_before_launch(cfg: Config, ranks: int, gpus: int | None = None, chosen: bool = False) -> None:
    """Raises the run's own error for what it would refuse at its start (`gpus`: this machine's, or the ones
    `chosen` for the run; None: CUDA's)."""
    check_ranks(cfg, ranks, torch.cuda.device_count() if gpus is None else gpus, chosen)
    check_model_path(cfg.model.path)
    sources = [*sources_of(cfg.data), *filter(None, [eval_source(cfg.data)])]
    for source in sources:
        if local_path(source.path):  # a hub dataset is fetched by the run itself
            read_records(source, cfg.data.cache_dir)


def check_ranks(cfg: Config, ranks: int, gpus: int, chosen: bool = False) -> None:
    """`chosen`: `gpus` counts the GPUs picked for the run (CUDA_VISIBLE_DEVICES), not all of this machine's."""
    if ranks < 1:
        raise UserError(f"ranks: {ranks}: a run needs one process at least (one a GPU, or 2 on a CPU)")
    if cfg.hardware.gpu == "cpu":
        return
    if gpus == 0 and chosen:
        raise UserError(f"no GPU is chosen, and the recipe is for {cfg.hardware.gpu}: tick the GPUs to use")
    if gpus == 0:
        raise UserError(f"this machine has no GPU, and the recipe is for {cfg.hardware.gpu}: pick a tiny_cpu recipe "
                        "to train on the CPU, or run on a machine with a GPU")
    if ranks > gpus:
        counted = f"{gpus} GPU{'s' if gpus > 1 else ''}"
        raise UserError(f"ranks: {ranks}, but {f'{counted} chosen' if chosen else f'this machine has {counted}'}: "
                        "one rank a GPU")
