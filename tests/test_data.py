"""Prompt masking, label shifting, sampler determinism, and bad-data messages."""

from __future__ import annotations

import pytest

from qlora_fsdp.config import DataConfig
from qlora_fsdp.data import IGNORE_INDEX, Sample, StepSampler, collate, read_alpaca, tokenize
from qlora_fsdp.errors import DataError
from qlora_fsdp.model import load_tokenizer
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_config(tiny_model_dir))


def test_only_response_tokens_are_targets(tokenizer):
    record = {"instruction": "Reverse the letters of the word.", "input": "stone", "output": "enots"}
    sample, truncated = tokenize(record, tokenizer, DataConfig(context_length=256))
    assert not truncated
    targets = [t for t, label in zip(sample.input_ids, sample.labels, strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(targets) == "enots" + tokenizer.eos_token
    assert sample.labels[: len(sample.labels) - len(targets)] == [IGNORE_INDEX] * (len(sample.labels) - len(targets))


def test_truncation_is_reported(tokenizer):
    record = {"instruction": "Repeat the word 5 times.", "input": "apple", "output": "apple " * 50}
    sample, truncated = tokenize(record, tokenizer, DataConfig(context_length=16))
    assert truncated and len(sample.input_ids) == 16


def test_collate_shifts_labels_and_pads():
    batch = collate([Sample([5, 6, 7], [IGNORE_INDEX, 6, 7]), Sample([5, 8], [IGNORE_INDEX, 8])], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [5, 8, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch.labels.tolist() == [[6, 7, IGNORE_INDEX], [8, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch.n_targets == 3 and batch.n_tokens == 5


def test_sampler_splits_steps_over_ranks_and_resumes():
    def sampler(rank):
        return StepSampler(n_samples=10, micro_batch_size=2, grad_accum_steps=2, world_size=2, rank=rank, seed=3)

    ranks = [sampler(0), sampler(1)]
    seen = []
    for _ in range(5):  # 5 steps of 8 samples = 4 epochs' worth of 10
        steps = [r.next_step() for r in ranks]
        flat = [i for s in steps for mb in s for i in mb]
        assert len(flat) == 8
        seen.extend(flat)
    assert sorted(seen[:10]) == list(range(10))  # the first epoch is a permutation
    resumed = sampler(0)
    resumed.load_state_dict(ranks[0].state_dict())
    assert resumed.next_step() == ranks[0].next_step()


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        read_alpaca(path)


def test_missing_field_names_record_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: record lacks the text field 'output'"):
        read_alpaca(path)
