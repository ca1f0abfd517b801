"""Allocating a meta-built model (fill.materialize) in one process: what `to_empty` would lose is kept."""

from __future__ import annotations

import torch

from qlora_fsdp.loading.build import build_meta_model
from qlora_fsdp.loading.checkpoint import load_hf_config
from qlora_fsdp.loading.fill import materialize
from tests.helpers import build_tiny_checkpoint, tiny_config


def test_materialize_keeps_a_tied_head_one_tensor(tmp_path):
    """to_empty gives every module a new tensor of its own; materialize must share the embeddings with the head again
    (else the head is a second matrix the checkpoint never fills)."""
    cfg = tiny_config(build_tiny_checkpoint(tmp_path / "tied", layers=1, family="qwen2"))  # qwen2 ties its head
    model = build_meta_model(cfg, load_hf_config(cfg)).get_base_model()
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight is embeddings.weight  # on the meta device, as transformers tied them
    materialize(model, torch.device("cpu"), torch.device("cpu"))
    assert head.weight is embeddings.weight
    assert head.weight.data_ptr() == embeddings.weight.data_ptr() != 0
