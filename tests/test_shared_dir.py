"""train.output_dir on storage every node sees (outputs/shared_dir.py), and resuming across new config keys."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from qlora_fsdp.config import Config, changed_settings, to_yaml
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.outputs.shared_dir import MARKER_PREFIX, check_shared_folder, spans_several_nodes
from tests.helpers import run_ranks


def shared_folder_outcomes(info, shared: Path, node_local: Path) -> tuple[list[str], list[str]]:
    """Rank 1 stands for another node's first process: it looks in the shared folder, then in one of its own."""
    outcomes = []
    for rank_1_folder in (shared, node_local):
        try:
            check_shared_folder(shared if info.rank == 0 else rank_1_folder, info, checks=info.rank == 1, wait_s=0.5)
            outcomes.append("ok")
        except ConfigError as err:
            outcomes.append(str(err))
    return outcomes, sorted(path.name for path in shared.iterdir())


@pytest.mark.slow
def test_output_dir_not_shared_by_nodes_fails_on_every_rank(tmp_path):
    shared, node_local = tmp_path / "shared", tmp_path / "node_local"
    node_local.mkdir()
    ranks = run_ranks(shared_folder_outcomes, 2, shared, node_local, tmp_dir=tmp_path / "ranks")
    assert ranks[0][1] == []  # rank 0 removed its marker before returning (rank 1 may have looked before that)
    for rank, ((same_folder, other_folder), _) in enumerate(ranks):
        assert same_folder == "ok"
        folder = shared if rank == 0 else node_local
        assert other_folder == (f"train.output_dir {folder} is not on storage shared by all nodes: rank 1 cannot see "
                                "a file rank 0 wrote there, and rank 0 alone writes checkpoints and the adapter; use "
                                "a shared filesystem (NFS, Lustre, ...) mounted at the same path on every node")
    assert not list(node_local.glob(f"{MARKER_PREFIX}*"))


def test_several_nodes_are_told_by_torchruns_local_world_size(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert not spans_several_nodes(4)  # not under torchrun: run_ranks' worlds, a plain python run
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert spans_several_nodes(16) and not spans_several_nodes(8)


def test_resuming_a_checkpoint_from_before_the_new_keys_names_no_change():
    """A checkpoint's config.yaml written before lora.use_rslora and optim.warmup_ratio existed ran with their
    defaults: resuming it reports no change, but does report one where the resumed run sets them."""
    old = Config()
    saved = yaml.safe_load(to_yaml(old))
    del saved["lora"]["use_rslora"], saved["optim"]["warmup_ratio"]
    assert changed_settings(yaml.safe_dump(saved), old) == []
    now = copy.deepcopy(old)
    now.optim.warmup_ratio, now.lora.use_rslora = 0.1, True
    assert changed_settings(yaml.safe_dump(saved), now) == ["lora.use_rslora: False -> True",
                                                            "optim.warmup_ratio: 0.0 -> 0.1"]
