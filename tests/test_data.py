"""The data pipeline: formats, templates and masking, packing, overlong samples, sampler, cache, bad data."""

from __future__ import annotations

import copy
import json

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

import qlora_fsdp.data.pipeline as data_module
from qlora_fsdp.config import DataConfig, SourceConfig
from qlora_fsdp.data.batching import Sample, StepSampler, collate, collate_packed, pack
from qlora_fsdp.data.pipeline import load_dataset
from qlora_fsdp.data.templates import IGNORE_INDEX, encode
from qlora_fsdp.errors import DataError
from qlora_fsdp.layers.attention import VARLEN_SDPA, flattens_packed_rows, transformers_name
from qlora_fsdp.loading.checkpoint import load_tokenizer
from tests.helpers import REPO, run_ranks, tiny_config

CHATML_JINJA = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green."}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_config(tiny_model_dir))


def targets_text(tokenizer, ids, labels) -> str:
    return tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def data_config(tmp_path, **values) -> DataConfig:
    return DataConfig(**{"cache_dir": str(tmp_path / "cache"), "eval_samples": 2, **values})


# ---- templates and masking -----------------------------------------------------------------------

def test_alpaca_loss_only_on_the_response(tokenizer):
    messages = [{"role": "user", "content": "Reverse the word.\n\n### Input:\nstone"},
                {"role": "assistant", "content": "enots"}]
    ids, labels = encode(messages, tokenizer, "alpaca", train_on_inputs=False)
    assert ids[0] == tokenizer.bos_token_id
    assert targets_text(tokenizer, ids, labels) == "enots" + tokenizer.eos_token
    assert tokenizer.decode(ids).startswith("<s>### Instruction:\nReverse the word.\n\n### Input:\nstone")
    ids, labels = encode(messages, tokenizer, "alpaca", train_on_inputs=True)
    assert labels == ids


@pytest.mark.parametrize("template", ["chatml", "tokenizer"])
def test_multi_turn_masks_every_non_assistant_turn(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHATML_JINJA
    ids, labels = encode(CHAT, tok, template, train_on_inputs=False)
    targets = targets_text(tok, ids, labels)
    assert "Blue." in targets and "Green." in targets
    for masked in ("Be brief.", "Name a color.", "Another one?", "system", "user"):
        assert masked not in targets, masked
    assert tok.decode(ids).count("<|im_start|>") == len(CHAT)


def test_plain_text_trains_on_every_token(tokenizer):
    ids, labels = encode([{"role": "text", "content": "Once upon a time."}], tokenizer, "alpaca", False)
    assert labels[1:] == ids[1:] and ids[-1] == tokenizer.eos_token_id


def test_formats_and_field_names(tokenizer, tmp_path):
    write_jsonl(tmp_path / "share.jsonl", [{"conversations": [{"from": "human", "value": f"hi {i}"},
                                                              {"from": "gpt", "value": f"hello {i}"}]}
                                           for i in range(20)])
    write_jsonl(tmp_path / "alpaca.jsonl", [{"prompt": f"say {i}", "answer": f"{i}"} for i in range(20)])
    share = load_dataset(tokenizer, data_config(tmp_path, path=str(tmp_path / "share.jsonl"), format="sharegpt"), 0)
    sample = share.samples(share.train, [0])[0]
    assert share.template == "chatml" and targets_text(tokenizer, sample.input_ids, sample.labels).startswith("hello")
    renamed = data_config(tmp_path, path=str(tmp_path / "alpaca.jsonl"),
                          fields={"instruction": "prompt", "output": "answer"})
    assert len(load_dataset(tokenizer, renamed, 0).train) == 18


# ---- packing ---------------------------------------------------------------------------------------

@pytest.mark.old_torch  # reaches torch code that differs between releases (tests/version_paths.py)
@pytest.mark.parametrize("attention", ["sdpa", "eager", VARLEN_SDPA, "flex_attention"])
def test_sample_loss_is_the_same_packed_as_alone(tiny_model_dir, tokenizer, attention):
    """Each kernel as a run hands it to transformers (flex: compiled with the main flex kernel for these short
    grouped-query rows, layers/flex_attention.py)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation=transformers_name(attention))
    texts = ["The cat sat on the mat.", "Reverse the letters: stone", "A much longer sample " * 4]
    samples = [Sample(*encode([{"role": "text", "content": t}], tokenizer, "alpaca", False)) for t in texts]

    def token_losses(batch):
        with torch.no_grad():
            inputs = batch.model_inputs(torch.device("cpu"), one_row=flattens_packed_rows(attention))
            logits = model(**inputs).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(),
                                                 ignore_index=IGNORE_INDEX, reduction="none").view(batch.labels.shape)

    packed = token_losses(collate_packed([samples, samples[:1]], pad_id=tokenizer.pad_token_id))
    start = 0
    for sample in samples:
        n = len(sample.input_ids)
        alone = token_losses(collate([sample], pad_id=tokenizer.pad_token_id))[0, :n]
        torch.testing.assert_close(packed[0, start : start + n], alone, rtol=1e-5, atol=1e-5)
        start += n
    assert packed[0, start:].abs().sum() == 0  # the padding tail is no target
    alone_first = token_losses(collate(samples[:1], pad_id=tokenizer.pad_token_id))[0]
    torch.testing.assert_close(packed[1, : len(samples[0].input_ids)], alone_first, rtol=1e-5, atol=1e-5)


def test_pack_places_every_sample_once_within_capacity():
    lengths = [int(x) for x in torch.randint(1, 100, (500,), generator=torch.Generator().manual_seed(0))]
    rows = pack(lengths, 128)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 128 for row in rows)
    assert sum(lengths) / (128 * len(rows)) > 0.9  # best-fit decreasing fills rows well
    assert pack(lengths, 128) == rows


# ---- overlong samples, held-out split, sampler -----------------------------------------------------

@pytest.mark.parametrize(("policy", "kept"), [("truncate", 10), ("drop", 5), ("split", 15)])
def test_overlong_samples_follow_the_recipe_and_are_counted(tokenizer, tmp_path, policy, kept):
    records = [{"text": "short text"} for _ in range(5)] + [{"text": "word " * 60} for _ in range(5)]
    path = write_jsonl(tmp_path / "text.jsonl", records)
    cfg = data_config(tmp_path, path=str(path), format="text", context_length=40, overlong=policy, eval_samples=0)
    data = load_dataset(tokenizer, cfg, 0)
    assert data.n_overlong == 5 and len(data.train) >= kept and max(data.train["length"]) <= 40
    if policy != "split":
        assert len(data.train) == kept


def test_eval_path_is_a_separate_held_out_set(tokenizer, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"instruction": f"a{i}", "output": "b"} for i in range(30)])
    held = write_jsonl(tmp_path / "eval.jsonl", [{"instruction": f"c{i}", "output": "d"} for i in range(7)])
    data = load_dataset(tokenizer, data_config(tmp_path, path=str(train), eval_path=str(held), eval_samples=5), 0)
    assert len(data.train) == 30 and len(data.eval) == 5


KINDS = {  # a kind of data: its records (from the shipped files) and the keys that make a recipe read them
    "samples": ("tiny_instruct.jsonl", {}, {}),
    "pairs": ("tiny_preferences.jsonl", {"format": "chat", "context_length": 320}, {"objective": "dpo"}),
    "unpaired": ("tiny_kto.jsonl", {"format": "chat", "context_length": 320}, {"objective": "kto"}),
    "prompts": ("tiny_prompts.jsonl", {"format": "prompt", "context_length": 32}, {"objective": "grpo"}),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_of_data_holds_out_a_tenth_at_most_or_the_eval_files_records(tiny_model_dir, tokenizer, tmp_path,
                                                                                 kind):
    """One rule for the held-out set, whatever the data: without data.eval_path at most a tenth of the records
    (eval_samples 200 of 30 records holds out 3, not 29), with it every record trains and eval_samples of the
    file's are held out. Read through the one loading entry the run uses."""
    from qlora_fsdp.data.training_data import load_training_data

    name, data_keys, train_keys = KINDS[kind]
    lines = (REPO / "data" / name).read_text().splitlines()
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(lines[:30]) + "\n")
    held = tmp_path / "held.jsonl"
    held.write_text("\n".join(lines[30:42]) + "\n")

    def loaded(**keys):
        cfg = tiny_config(tiny_model_dir, data={"path": str(train), "cache_dir": str(tmp_path / "cache"),
                                                **data_keys, **keys}, train=train_keys,
                          generation={"max_completion_length": 8})
        data = load_training_data(tokenizer, cfg, None, lambda: pytest.fail("text records need no processor"))
        return len(data.train), len(data.eval)

    assert loaded(eval_samples=200) == (27, 3)
    assert loaded(eval_samples=2) == (28, 2)
    assert loaded(eval_samples=200, eval_path=str(held)) == (30, 12)
    assert loaded(eval_samples=5, eval_path=str(held)) == (30, 5)


def test_sampler_shards_over_ranks_and_resumes_exactly():
    def sampler(rank, lengths=None):
        return StepSampler(16, micro_batch_size=2, grad_accum_steps=2, world_size=2, rank=rank, seed=3,
                           lengths=lengths)

    ranks = [sampler(0), sampler(1)]
    epochs = []
    for _ in range(3):  # 2 steps of 8 units (both ranks) per epoch of 16
        epochs.append([i for _ in range(2) for r in ranks for mb in r.next_step() for i in mb])
    assert all(sorted(epoch) == list(range(16)) for epoch in epochs)  # each epoch: every unit once
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    resumed = sampler(0)
    resumed.load_state_dict(ranks[0].state_dict())
    assert [resumed.next_step() for _ in range(3)] == [ranks[0].next_step() for _ in range(3)]


def test_length_grouping_keeps_each_steps_samples_and_cuts_padding():
    lengths = [int(x) for x in torch.randint(5, 120, (64,), generator=torch.Generator().manual_seed(1))]
    plain = [StepSampler(64, 4, 2, 2, r, seed=0) for r in range(2)]
    grouped = [StepSampler(64, 4, 2, 2, r, seed=0, lengths=lengths) for r in range(2)]
    padded = {"plain": 0, "grouped": 0}
    for _ in range(8):
        plain_step = [r.next_step() for r in plain]
        grouped_step = [r.next_step() for r in grouped]
        assert sorted(i for s in plain_step for mb in s for i in mb) == sorted(
            i for s in grouped_step for mb in s for i in mb)
        for name, step in (("plain", plain_step), ("grouped", grouped_step)):
            padded[name] += sum(len(mb) * max(lengths[i] for i in mb) for s in step for mb in s)
    assert padded["grouped"] < 0.8 * padded["plain"]


# ---- sources, mixing, cache --------------------------------------------------------------------------

def test_sources_of_every_kind_mix_by_weight(tokenizer, tmp_path):
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(10)]
    write_jsonl(tmp_path / "a.jsonl", rows)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "b.parquet"))
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "c.csv"), index=False)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "d_saved"))
    sources = [SourceConfig(path=str(tmp_path / "a.jsonl"), weight=2.0),
               SourceConfig(path=str(tmp_path / "b.parquet"), weight=0.5),
               SourceConfig(path=str(tmp_path / "c.csv")), SourceConfig(path=str(tmp_path / "d_saved"))]
    data = load_dataset(tokenizer, data_config(tmp_path, sources=sources, eval_samples=0), 0)
    assert data.n_records == 20 + 5 + 10 + 10 == len(data.train)


def test_tokenization_is_cached(tokenizer, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": f"q{i}", "output": "a"} for i in range(30)])
    cfg = data_config(tmp_path, path=str(path))
    first = load_dataset(tokenizer, cfg, 0)
    calls = []
    monkeypatch.setattr(data_module, "encode", lambda *args: calls.append(1) or encode(*args))
    second = load_dataset(tokenizer, cfg, 0)
    assert calls == [] and second.train["input_ids"] == first.train["input_ids"]


def test_the_cache_key_is_the_tokenizer_and_the_settings_not_its_pickle(tokenizer):
    """Tokenization's cache key (data/fingerprint.py) without pickling the tokenizer: equal for an equal tokenizer,
    unchanged by encoding with it, new for another input, another vocabulary, chat template or setting."""
    import copy

    from qlora_fsdp.data.fingerprint import map_fingerprint

    key = map_fingerprint("input", tokenizer, "Tokenize", "alpaca", False)
    encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], tokenizer, "alpaca", False, "")
    assert key is not None and key == map_fingerprint("input", copy.deepcopy(tokenizer), "Tokenize", "alpaca", False)
    grown, templated = copy.deepcopy(tokenizer), copy.deepcopy(tokenizer)
    grown.add_tokens(["<new-token>"])
    templated.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    others = {map_fingerprint("other input", tokenizer, "Tokenize", "alpaca", False),
              map_fingerprint("input", grown, "Tokenize", "alpaca", False),
              map_fingerprint("input", templated, "Tokenize", "alpaca", False),
              map_fingerprint("input", tokenizer, "Tokenize", "chatml", False),
              map_fingerprint("input", tokenizer, "Tokenize", "alpaca", True)}
    assert len(others) == 5 and key not in others


def test_malformed_line_names_file_and_line(tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_dataset(tokenizer, data_config(tmp_path, path=str(path)), 0)


def test_missing_field_names_record_and_field(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "a", "output": 3}])
    with pytest.raises(DataError, match=r"bad.jsonl: record 2 lacks the text field 'output'"):
        load_dataset(tokenizer, data_config(tmp_path, path=str(path)), 0)


def test_empty_after_filtering_is_an_error(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [{"instruction": "word " * 50, "output": "b"}] * 3)
    with pytest.raises(DataError, match="no trainable samples"):
        load_dataset(tokenizer, data_config(tmp_path, path=str(path), context_length=16), 0)


def count_tokenizations(info, cfg, data_cfg):
    calls = []
    original = data_module.encode
    data_module.encode = lambda *args: calls.append(1) or original(*args)
    try:
        data = load_dataset(load_tokenizer(cfg), data_cfg, 0, info)
    finally:
        data_module.encode = original  # the pool's worker serves other tests next
    return len(calls), data.train["input_ids"]


@pytest.mark.slow
def test_each_node_tokenizes_once(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": f"q{i}", "output": "a"} for i in range(40)])
    results = run_ranks(count_tokenizations, 2, tiny_config(tiny_model_dir), data_config(tmp_path, path=str(path)),
                        tmp_dir=tmp_path)
    assert results[0][0] == 40 and results[1][0] == 0  # rank 1 read rank 0's cache
    assert results[0][1] == results[1][1]


def test_training_and_generation_share_one_template_choice(tokenizer):
    """Chat data under data.sources on a tokenizer without a chat template: chatml for training and for the tools
    (generation once chose from data.format, the alpaca default, instead)."""
    from qlora_fsdp.data.pipeline import run_template

    data = DataConfig(sources=[SourceConfig(path="chats.jsonl", format="chat")])
    assert data.format == "alpaca" and not getattr(tokenizer, "chat_template", None)
    assert run_template(data, tokenizer) == "chatml"
    assert run_template(DataConfig(path="records.jsonl"), tokenizer) == "alpaca"
