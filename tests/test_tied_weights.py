"""A head tied to the embeddings (Llama 3.2 1B/3B, Qwen2.5 up to 3B, Gemma, SmolLM2) on every path, at world sizes
1 and 2: loading with and without fsdp.param_dtype and with CPU offload, training, resume, adapter export, sampling
in one process and offloaded, the merge and the planner. The head and the embeddings stay one tensor, and the
numbers equal transformers' and PEFT's on the same tied model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from qlora_fsdp.api import train
from qlora_fsdp.data.templates import prompt_ids
from qlora_fsdp.loading.adapter import config_for_adapter
from qlora_fsdp.loading.checkpoint import load_hf_config
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.loading.sharding import sharded_meta_model
from qlora_fsdp.losses.forward import loss_sum
from qlora_fsdp.measure.held import held_bytes, nbytes
from qlora_fsdp.tools.adapter_merge import merge_adapter
from qlora_fsdp.tools.adapter_sampling import Sampling, load_generator
from tests.helpers import (
    batches,
    build_tiny_checkpoint,
    run_ranks_sequence,
    tiny_config,
    transformers_nf4,
    variable_length_samples,
)

pytestmark = pytest.mark.slow  # every test loads on gloo ranks

PROMPT = "Reverse the word: planet"
PAD = 2
LOADINGS = {"plain": {}, "param_dtype": {"param_dtype": "bfloat16"}, "offload": {"cpu_offload": True}}


def head_and_embeddings(model: torch.nn.Module) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return base.get_output_embeddings().weight, base.get_input_embeddings().weight


def one_tensor(model: torch.nn.Module) -> bool:
    """The head is the embeddings' parameter; unsharded, one storage too."""
    head, embeddings = head_and_embeddings(model)
    if isinstance(head, DTensor):
        return head is embeddings
    return head is embeddings and head.data_ptr() == embeddings.data_ptr()


def loaded_losses(info, cfg, batch) -> dict[str, tuple[bool, float]]:
    """Per way of loading: (head and embeddings one tensor, loss per target token)."""
    out = {}
    for name, fsdp in LOADINGS.items():
        model = build_sharded_model(dataclasses.replace(cfg, fsdp=dataclasses.replace(cfg.fsdp, **fsdp)), info)
        with torch.no_grad():
            out[name] = (one_tensor(model), loss_sum(model, batch, info.device).item() / batch.n_targets)
    return out


def trained_and_resumed(info, cfg, root: Path) -> tuple[dict, dict]:
    """3 steps straight (a checkpoint each step), and a resume of its step 2 to step 3 in another folder:
    (uninterrupted summary, resumed summary)."""
    def run(name: str, resume: str = "never") -> dict:
        train_cfg = dataclasses.replace(cfg.train, max_steps=3, output_dir=str(root / name), resume=resume,
                                        save_every=1, keep_last=3)
        return train(dataclasses.replace(cfg, train=train_cfg), info=info)

    straight = run("straight")
    return straight, run("resumed", resume=str(root / "straight" / "checkpoints" / "step-000002"))


def sampled(info, adapter: Path, offload: bool, input_ids: torch.Tensor) -> tuple[bool, list[int], torch.Tensor]:
    """(head tied, greedy reply, logits of `input_ids`) as generate.py holds the model."""
    generator = load_generator(config_for_adapter(adapter, None, []), adapter, offload)
    with torch.no_grad():
        logits = generator.model(input_ids=input_ids.to(info.device)).logits.cpu()
    return one_tensor(generator.model), generator.token_ids(PROMPT, Sampling(max_new_tokens=10)), logits


def planned(info, cfg) -> tuple[int, int]:
    """(the planner's frozen non-4-bit bytes, the bytes of one embedding shard plus the norms' and biases')."""
    model = sharded_meta_model(cfg, load_hf_config(cfg), info.mesh)
    _, embeddings = head_and_embeddings(model)
    others = sum(nbytes(p.to_local() if isinstance(p, DTensor) else p)
                for n, p in model.named_parameters() if "norm" in n or n.endswith("bias"))
    shard = embeddings.to_local() if isinstance(embeddings, DTensor) else embeddings
    return held_bytes(model, cfg).other_base, nbytes(shard) + others


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tiny Llama-shaped model whose head is its embeddings (the qwen2 family ties them), a batch, a prompt."""
    root = tmp_path_factory.mktemp("tied")
    model_dir = build_tiny_checkpoint(root / "model", family="qwen2")
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # as on the hub: the checkpoint holds the embeddings only
    cfg = tiny_config(model_dir, optim={"lr": 3e-3}, data={"micro_batch_size": 4, "eval_samples": 16},
                      train={"max_steps": 3})
    batch = batches(variable_length_samples(cfg, 6), 6, PAD)[0]
    ids = torch.tensor([prompt_ids([{"role": "user", "content": PROMPT}], AutoTokenizer.from_pretrained(model_dir),
                                   "alpaca")])
    return root, model_dir, cfg, batch, ids


@pytest.fixture(scope="module")
def runs(tied):
    """Everything the ranks compute, world size 1 then 2, each in one start-up. The adapter sampled at both world
    sizes is the one trained in one process."""
    root, _, cfg, batch, ids = tied
    adapter = root / "ws1" / "straight" / "adapter"
    out = {}
    for world_size in (1, 2):
        calls = [(loaded_losses, (cfg, batch)), (planned, (cfg,))]
        if world_size == 1:
            calls.append((trained_and_resumed, (cfg, root / "ws1")))
        calls += [(sampled, (adapter, offload, ids)) for offload in (False, True)]
        out[world_size] = run_ranks_sequence(calls, world_size, root / f"ranks{world_size}")
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_tied_model_loads_as_one_tensor_with_transformers_loss(tied, runs, world_size):
    _, model_dir, _, batch, _ = tied
    with torch.no_grad():
        reference = loss_sum(transformers_nf4(model_dir), batch, torch.device("cpu")).item() / batch.n_targets
    losses = runs[world_size][0]
    for name, (is_one, loss) in losses.items():
        assert is_one, name
        # fp32 compute equals transformers' to rounding; the bf16 mixed-precision policy to bf16 rounding
        assert loss == pytest.approx(reference, rel=2e-2 if name == "param_dtype" else 1e-5), name


@pytest.mark.parametrize("world_size", [1, 2])
def test_planner_counts_the_tied_tensor_once(runs, world_size):
    other_base, embedding_and_norms = runs[world_size][1]
    assert other_base == embedding_and_norms


def test_one_process_trains_resumes_and_exports_a_tied_model(tied, runs):
    root, model_dir, _, _, ids = tied
    straight, resumed = runs[1][2]
    assert straight["eval_loss_end"] < straight["eval_loss_start"]
    assert resumed["eval_loss_end"] == pytest.approx(straight["eval_loss_end"], rel=1e-6)
    # PEFT loads the exported adapter onto transformers' own 4-bit tied model: the live model's logits
    peft_model = PeftModel.from_pretrained(transformers_nf4(model_dir), root / "ws1" / "straight" / "adapter")
    assert one_tensor(peft_model)
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    ours = runs[1][3][2]
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()


@pytest.mark.parametrize("world_size", [1, 2])
def test_sampling_a_tied_model_in_one_process_offloaded_and_sharded(runs, world_size):
    unsharded = runs[1][3]
    for is_one, tokens, logits in runs[world_size][-2:]:
        assert is_one and tokens == unsharded[1]
        assert (logits - unsharded[2]).abs().max() < 1e-4 * unsharded[2].abs().max()


def test_merged_tied_model_stays_tied_and_gives_the_live_logits(tied, runs, tmp_path):
    root, _, _, _, ids = tied
    adapter = root / "ws1" / "straight" / "adapter"
    merge_adapter(config_for_adapter(adapter, None, []), adapter, tmp_path / "merged", "float32")
    with safe_open(tmp_path / "merged" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert one_tensor(merged)
    with torch.no_grad():
        logits = merged(input_ids=ids).logits
    live = runs[1][3][2]
    assert (logits - live).abs().max() < 1e-4 * live.abs().max()
