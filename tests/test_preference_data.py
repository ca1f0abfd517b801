"""Preference pairs: the record shapes people write, bad pairs by record, the completions' targets under the
published chat templates, fitting to the context, and each sequence's log-probability packed as alone."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

from qlora_fsdp.config import SourceConfig
from qlora_fsdp.data.batching import Sample, collate, collate_packed
from qlora_fsdp.data.pair_encoding import EncodedPair, encode_pair, fit_pair
from qlora_fsdp.data.pair_pipeline import load_pairs
from qlora_fsdp.data.pair_records import PairMaker, as_pairs, good_pairs
from qlora_fsdp.errors import DataError
from qlora_fsdp.labels import IGNORE_INDEX
from qlora_fsdp.layers.attention import VARLEN_SDPA
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.losses.forward import ForwardLoss
from tests.helpers import tiny_config
from tests.test_chat_templates import family_tokenizer, target_runs

QUESTION, GOOD, BAD = "Name a color.", "Blue.", "Seven."


def turns(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in pairs]


def read(record: dict, format: str = "chat", **fields: str) -> dict:
    return PairMaker(SourceConfig(path="prefs.jsonl", format=format, fields=fields))(record, 0)


def texts(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


# ---- record shapes --------------------------------------------------------------------------------

SHAPES = {
    "trl strings": {"prompt": QUESTION, "chosen": GOOD, "rejected": BAD},
    "trl messages": {"prompt": turns(("user", QUESTION)), "chosen": turns(("assistant", GOOD)),
                     "rejected": turns(("assistant", BAD))},
    "trl implicit prompt": {"chosen": turns(("user", QUESTION), ("assistant", GOOD)),
                            "rejected": turns(("user", QUESTION), ("assistant", BAD))},
    "ultrafeedback": {"prompt": QUESTION, "chosen": turns(("user", QUESTION), ("assistant", GOOD)),
                      "rejected": turns(("user", QUESTION), ("assistant", BAD)), "score_chosen": 8.0,
                      "score_rejected": 3.0, "messages": turns(("user", QUESTION), ("assistant", GOOD))},
}


@pytest.mark.parametrize("shape", SHAPES)
def test_every_record_shape_gives_the_same_pair(shape):
    pair = read(SHAPES[shape])
    assert pair["problem"] == ""
    assert texts(pair["prompt"]) == [("user", QUESTION)]
    assert texts(pair["chosen"]) == [("assistant", GOOD)] and texts(pair["rejected"]) == [("assistant", BAD)]


def test_sharegpt_ranking_records_with_a_system_turn():
    """LLaMA-Factory's ranking format: conversations in from/value turns, chosen and rejected one turn each."""
    record = {"conversations": [{"from": "human", "value": "Hi."}, {"from": "gpt", "value": "Hello."},
                                {"from": "human", "value": QUESTION}],
              "chosen": {"from": "gpt", "value": GOOD}, "rejected": {"from": "gpt", "value": BAD},
              "system": "Be brief."}
    pair = read(record, "sharegpt")
    assert texts(pair["prompt"]) == [("system", "Be brief."), ("user", "Hi."), ("assistant", "Hello."),
                                     ("user", QUESTION)]
    assert texts(pair["chosen"]) == [("assistant", GOOD)] and texts(pair["rejected"]) == [("assistant", BAD)]


def test_multi_turn_implicit_prompt_ends_before_the_completions():
    shared = [("user", "Hi."), ("assistant", "Hello."), ("user", QUESTION)]
    pair = read({"chosen": turns(*shared, ("assistant", GOOD)), "rejected": turns(*shared, ("assistant", BAD))})
    assert texts(pair["prompt"]) == shared


@pytest.mark.parametrize(("record", "problem"), [
    ({"prompt": QUESTION, "chosen": "", "rejected": BAD}, "the chosen completion is empty"),
    ({"prompt": QUESTION, "chosen": GOOD, "rejected": "  "}, "the rejected completion is empty"),
    ({"prompt": QUESTION, "chosen": GOOD, "rejected": GOOD}, "chosen and rejected are the same"),
    ({"prompt": QUESTION, "chosen": turns(("user", "Another question?"), ("assistant", GOOD)),
      "rejected": turns(("user", QUESTION), ("assistant", BAD))}, "the prompts disagree"),
    ({"chosen": turns(("user", "A?"), ("assistant", GOOD)), "rejected": turns(("user", "B?"), ("assistant", BAD))},
     "share no opening turns"),
])
def test_bad_pairs_say_why(record, problem):
    assert problem in read(record)["problem"]


def test_bad_pairs_name_the_file_and_record_or_are_dropped_and_counted(tmp_path):
    records = [{"prompt": QUESTION, "chosen": GOOD, "rejected": BAD}] * 3
    records[1] = {"prompt": QUESTION, "chosen": GOOD, "rejected": GOOD}
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    pairs = as_pairs(datasets.load_dataset("json", data_files=str(path), split="train"),
                     SourceConfig(path=str(path), format="chat"))
    with pytest.raises(DataError) as err:
        good_pairs(pairs, drop_bad=False)
    assert str(err.value) == (f"{path}: record 2: chosen and rejected are the same "
                              "(or set preference.bad_pairs: drop)")
    kept, dropped = good_pairs(pairs, drop_bad=True)
    assert (len(kept), dropped) == (2, 1)


def test_a_pair_whose_prompt_fills_the_context_names_its_record_or_is_dropped_and_counted(tiny_model_dir, tmp_path):
    """Under `overlong: truncate` the prompt is kept whole; a prompt that leaves the completions no room is a bad
    pair (file and record named; `bad_pairs: drop` drops and counts it). `overlong: drop` drops it as chosen."""
    records = [{"prompt": QUESTION, "chosen": GOOD, "rejected": BAD}] * 12
    records[4] = {"prompt": "Name a color. " * 40, "chosen": GOOD, "rejected": BAD}
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))

    def loaded(**settings):
        cfg = tiny_config(tiny_model_dir, data={"path": str(path), "format": "chat", "context_length": 200,
                                                 "eval_samples": 2, "cache_dir": str(tmp_path / "cache"),
                                                 "overlong": settings.pop("overlong", "truncate")},
                          train={"objective": "dpo"}, preference=settings)
        return load_pairs(load_tokenizer(cfg), cfg)

    with pytest.raises(DataError) as err:
        loaded()
    said = str(err.value)
    assert said.startswith(f"{path}: record 5: its prompt's ") and "leave no room for both completions in " \
        "data.context_length 200; raise data.context_length (or set preference.bad_pairs: drop)" in said, said
    for data in (loaded(bad_pairs="drop"), loaded(overlong="drop")):
        assert (data.n_records, len(data.train) + len(data.eval), data.n_overlong, data.n_without_targets) == (
            12, 11, 1, 1)


# ---- the completions' targets ------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama-3.1", "qwen2.5", "qwen3", "gemma-2", "mistral-nemo", "chatml"])
def test_only_the_completions_are_targets_under_published_templates(family):
    """A multi-turn prompt (its assistant turn is context here) and completions that start alike: the targets are
    each completion's reply and its end of turn (Qwen3's empty thinking block before the reply, as in SFT), and the
    two sequences share exactly the prompt's tokens."""
    tokenizer = family_tokenizer(family)
    template = "chatml" if family == "chatml" else "tokenizer"
    prompt = turns(("user", "Name a color."), ("assistant", "Blue."), ("user", "Another one?"))
    chosen, rejected = turns(("assistant", "Green, like grass.")), turns(("assistant", "Green is not a color."))
    pair = encode_pair(prompt, chosen, rejected, "", tokenizer, template)
    runs = [target_runs(tokenizer, s.input_ids, s.labels) for s in (pair.chosen, pair.rejected)]
    assert len(runs[0]) == len(runs[1]) == 1, runs
    parts = [run.split(reply) for run, reply in ((runs[0][0], "Green, like grass."), (runs[1][0],
                                                                                     "Green is not a color."))]
    assert [len(split) for split in parts] == [2, 2], runs  # each completion's whole reply is in its targets
    (before, end), (other_before, other_end) = parts
    assert before == other_before == ("<think>\n\n</think>\n\n" if family == "qwen3" else "")
    assert end == other_end and end.strip() != ""  # the template's end of turn, the same for both
    start = pair.prompt_tokens
    assert pair.chosen.input_ids[:start] == pair.rejected.input_ids[:start]
    assert pair.chosen.labels[start] != IGNORE_INDEX and pair.chosen.labels[start - 1] == IGNORE_INDEX


def test_fitting_keeps_the_prompt_and_shortens_the_longer_completion_first():
    def sample(n_prompt, n_completion):
        ids = list(range(n_prompt + n_completion))
        return Sample(ids, [IGNORE_INDEX] * n_prompt + ids[n_prompt:])

    pair = EncodedPair(sample(10, 30), sample(10, 5), prompt_tokens=10)
    assert fit_pair(pair, 55, "truncate") is pair
    fitted = fit_pair(pair, 40, "truncate")
    assert fitted is not None and fitted.length == 40
    assert (len(fitted.chosen.input_ids), len(fitted.rejected.input_ids)) == (25, 15)  # the rejected kept whole
    assert fit_pair(pair, 40, "drop") is None
    assert fit_pair(pair, 21, "truncate") is None  # no room for a token of each completion after the prompts
    both_long = fit_pair(EncodedPair(sample(10, 30), sample(10, 30), 10), 40, "truncate")
    assert both_long is not None and both_long.length == 40 and len(both_long.chosen.input_ids) == 20


# ---- log-probabilities per sequence -------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["sdpa", VARLEN_SDPA])
def test_each_sequences_log_probability_is_the_same_packed_unpacked_and_alone(tiny_model_dir, attention):
    """Pairs packed several to a row, one pair a row, and each sequence alone give the same per-sequence sums,
    with the full logits and chunked; the gradients agree too."""
    tokenizer = load_tokenizer(tiny_config(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attention)
    questions = [("Name a color.", "Blue.", "Seven."), ("Add 2 and 3.", "5", "It is 6, I think."),
                 ("Say hi.", "Hi!", "No.")]
    pairs = [encode_pair(turns(("user", q)), turns(("assistant", g)), turns(("assistant", b)), "", tokenizer,
                         "chatml") for q, g, b in questions]
    sequences = [s for p in pairs for s in (p.chosen, p.rejected)]
    device, pad = torch.device("cpu"), tokenizer.pad_token_id

    def logps(batch, chunk_tokens):  # as training computes them (ForwardLoss.per_sample)
        model.zero_grad()
        out = ForwardLoss(chunk_tokens).per_sample(model, batch, device)
        out.sum().backward()
        return -out.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    alone = torch.cat([logps(collate([s], pad), None)[0] for s in sequences])
    packed, packed_grad = logps(collate_packed([sequences[:4], sequences[4:]], pad), None)
    one_pair_a_row, row_grad = logps(collate_packed([sequences[i : i + 2] for i in range(0, 6, 2)], pad), 3)
    chunked, chunked_grad = logps(collate_packed([sequences[:4], sequences[4:]], pad), 3)
    assert (alone < 0).all()
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one_pair_a_row, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, packed, rtol=1e-5, atol=1e-5)
    for grad in (chunked_grad, row_grad):  # float rounding apart (summed in another order)
        assert (grad - packed_grad).norm() <= 1e-5 * packed_grad.norm()
