"""Tool-call data, both shapes, read from files through the pipeline: the assistant's calls (as each template writes
them) and its end-of-turn are targets; tool results and the tools' schemas are rendered but never trained on.

ShareGPT as glaive / LLaMA-Factory write it: `function_call` turns holding {"name", "arguments"} as JSON text and
`observation` turns, plus a record-level `tools` (JSON text): fixtures/chat_templates/glaive_style_tool_calls.json.
Chat records as OpenAI writes them: assistant `tool_calls` (arguments as JSON text or an object) and `tool` turns.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qlora_fsdp.config import DataConfig, SourceConfig, Template
from qlora_fsdp.data.pipeline import tokenized
from qlora_fsdp.data.templates import IGNORE_INDEX, encode
from qlora_fsdp.errors import DataError
from tests.test_chat_templates import FIXTURES, assert_targets, family_tokenizer, target_runs, with_template

GLAIVE = FIXTURES / "glaive_style_tool_calls.json"
RECTANGLE = '{"name": "calculate_area", "ARGS": {"shape": "rectangle", "dimensions": [5, 3]}}'
CIRCLE = '{"name": "calculate_area", "ARGS": {"shape": "circle", "dimensions": [2]}}'
EUROS = '{"name": "convert_currency", "ARGS": {"amount": 100, "from": "USD", "to": "EUR"}}'


def hermes(call: str) -> str:  # Qwen's and our chatml's way to write a call
    return "<tool_call>\n" + call.replace("ARGS", "arguments") + "\n</tool_call>"


def llama(call: str) -> str:  # Llama 3.1 writes the arguments as "parameters"
    return call.replace("ARGS", "parameters")


def template_of(family: str) -> Template:
    return "chatml" if family == "chatml" else "tokenizer"


def read_and_encode(tmp_path: Path, family: str, path: Path, data_format: str) -> list[tuple[list[int], list[int]]]:
    """Each record's (ids, labels), read, converted and tokenized by the pipeline (datasets.map, Arrow)."""
    data = DataConfig(cache_dir=str(tmp_path / "cache"), context_length=4096)
    samples = tokenized([SourceConfig(path=str(path), format=data_format)], family_tokenizer(family), data,
                        template_of(family), seed=0)[0]
    assert samples["record"] == list(range(len(samples)))  # nothing dropped, in order
    return list(zip(samples["input_ids"], samples["labels"], strict=True))


# ---- ShareGPT function_call / observation ---------------------------------------------------------------

GLAIVE_TARGETS = {
    "qwen2.5": [hermes(RECTANGLE) + "<|im_end|>", "The rectangle covers 15 square units.<|im_end|>",
                hermes(CIRCLE) + "<|im_end|>", "About 12.57 square units.<|im_end|>"],
    "qwen3": [hermes(RECTANGLE) + "<|im_end|>", "The rectangle covers 15 square units.<|im_end|>",
              hermes(CIRCLE) + "<|im_end|>", "<think>\n\n</think>\n\nAbout 12.57 square units.<|im_end|>"],
    "llama-3.1": [llama(RECTANGLE) + "<|eot_id|>", "The rectangle covers 15 square units.<|eot_id|>",
                  llama(CIRCLE) + "<|eot_id|>", "About 12.57 square units.<|eot_id|>"],
    "chatml": [hermes(RECTANGLE) + "<|im_end|></s>", "The rectangle covers 15 square units.<|im_end|></s>",
               hermes(CIRCLE) + "<|im_end|></s>", "About 12.57 square units.<|im_end|></s>"],
    "mistral-nemo": ['[TOOL_CALLS][' + RECTANGLE.replace("ARGS", "arguments")[:-1] + ', "id": "call00001"}]</s>',
                     "The rectangle covers 15 square units.</s>",
                     '[TOOL_CALLS][' + CIRCLE.replace("ARGS", "arguments")[:-1] + ', "id": "call00002"}]</s>',
                     "About 12.57 square units.</s>"],
}
NEVER_TARGETS = ['"description": "Area of a flat shape"', "12.57}", "What is the area of a rectangle 5 by 3?"]


@pytest.mark.parametrize("family", sorted(GLAIVE_TARGETS))
def test_sharegpt_function_calls_train_the_calls_not_the_results(tmp_path, family):
    tokenizer = family_tokenizer(family)
    (ids, labels), second, riddle = read_and_encode(tmp_path, family, GLAIVE, "sharegpt")
    assert target_runs(tokenizer, ids, labels) == GLAIVE_TARGETS[family]
    text, targets = tokenizer.decode(ids), "".join(target_runs(tokenizer, ids, labels))
    for rendered in NEVER_TARGETS:  # the schema (system text or first user turn), a result, the question
        assert rendered in text and rendered not in targets, rendered
    assert "100 USD is 92.50 EUR today." in target_runs(tokenizer, *second)[-1]
    assert "What has keys but opens no locks? A piano." in target_runs(tokenizer, *riddle)[0]
    assert "calculate_area" not in tokenizer.decode(riddle[0])  # "tools": "[]" is no tools


# ---- chat records with OpenAI tool_calls and tool turns ---------------------------------------------------

AREA_TOOL = {"name": "calculate_area", "description": "Area of a flat shape",
             "parameters": {"type": "object", "properties": {"shape": {"type": "string"}}}}
OPENAI_RECORDS = [
    {"messages": [{"role": "system", "content": "You convert money."},
                  {"role": "user", "content": "How many euros is 100 dollars?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_a1", "type": "function", "function": {
                          "name": "convert_currency", "arguments": '{"amount": 100, "from": "USD", "to": "EUR"}'}}]},
                  {"role": "tool", "tool_call_id": "call_a1", "content": '{"converted": 92.5}'},
                  {"role": "assistant", "content": "100 USD is 92.50 EUR today."}],
     "tools": [{"type": "function", "function": {"name": "convert_currency", "description": "Convert money",
                                                 "parameters": {"type": "object", "properties": {}}}}]},
    {"messages": [{"role": "user", "content": "What is the area of a rectangle 5 by 3?"},
                  {"role": "assistant", "content": "Let me compute that.", "tool_calls": [
                      {"type": "function", "function": {"name": "calculate_area",
                                                        "arguments": {"shape": "rectangle", "dimensions": [5, 3]}}}]},
                  {"role": "tool", "content": '{"area": 15}'},
                  {"role": "assistant", "content": "The rectangle covers 15 square units."}],
     "tools": [AREA_TOOL]},
]
OPENAI_TARGETS = {
    "qwen2.5": [[hermes(EUROS) + "<|im_end|>", "100 USD is 92.50 EUR today.<|im_end|>"],
                ["Let me compute that.\n" + hermes(RECTANGLE) + "<|im_end|>",
                 "The rectangle covers 15 square units.<|im_end|>"]],
    "qwen3": [[hermes(EUROS) + "<|im_end|>", "<think>\n\n</think>\n\n100 USD is 92.50 EUR today.<|im_end|>"],
              ["Let me compute that.\n" + hermes(RECTANGLE) + "<|im_end|>",
               "<think>\n\n</think>\n\nThe rectangle covers 15 square units.<|im_end|>"]],
    "llama-3.1": [[llama(EUROS) + "<|eot_id|>", "100 USD is 92.50 EUR today.<|eot_id|>"],
                  [llama(RECTANGLE) + "<|eot_id|>",  # the template drops a calling message's text
                   "The rectangle covers 15 square units.<|eot_id|>"]],
    "chatml": [[hermes(EUROS) + "<|im_end|></s>", "100 USD is 92.50 EUR today.<|im_end|></s>"],
               ["Let me compute that.\n" + hermes(RECTANGLE) + "<|im_end|></s>",
                "The rectangle covers 15 square units.<|im_end|></s>"]],
}


@pytest.mark.parametrize("family", sorted(OPENAI_TARGETS))
def test_openai_tool_calls_train_the_calls_not_the_results(tmp_path, family):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in OPENAI_RECORDS))
    tokenizer = family_tokenizer(family)
    for (ids, labels), expected in zip(read_and_encode(tmp_path, family, path, "chat"), OPENAI_TARGETS[family],
                                       strict=True):
        assert target_runs(tokenizer, ids, labels) == expected
        text, targets = tokenizer.decode(ids), "".join(expected)
        result = '{"converted": 92.5}' if "USD" in text else '{"area": 15}'
        for rendered in ('"description": "', result):  # Llama 3.1's template writes a tool's result as JSON text
            assert rendered in text.replace('\\"', '"') and rendered not in targets, rendered


@pytest.mark.parametrize("family", ["qwen3", "chatml"])
def test_parallel_calls_are_one_turn(family):
    calls = json.dumps([{"name": "calculate_area", "arguments": {"shape": "rectangle", "dimensions": [5, 3]}},
                        {"name": "calculate_area", "arguments": {"shape": "circle", "dimensions": [2]}}])
    messages = [{"role": "user", "content": "Two areas?"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    ids, labels = encode(messages, family_tokenizer(family), template_of(family), False, [AREA_TOOL])
    thinking, end = ("", "<|im_end|></s>") if family == "chatml" else ("<think>\n\n</think>\n\n", "<|im_end|>")
    assert target_runs(family_tokenizer(family), ids, labels) == [
        thinking + hermes(RECTANGLE) + "\n" + hermes(CIRCLE) + end]


# ---- refusals, one line each ----------------------------------------------------------------------------

def write_sharegpt(tmp_path: Path, bad_turn: dict, tools: str = "[]") -> Path:
    good = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}], "tools": "[]"}
    bad = {"conversations": [{"from": "human", "value": "Area?"}, bad_turn, {"from": "gpt", "value": "15"}],
           "tools": tools}
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    return path


@pytest.mark.parametrize(("turn", "tools", "why"), [
    ({"from": "function_call", "value": '{"name": "calculate_area", "arguments": {"shape": '}, "[]",
     r"has a tool call that is not a JSON \{name, arguments\} object \(Expecting value"),
    ({"from": "function_call", "value": '{"arguments": {"shape": "square"}}'}, "[]", "needs a function name"),
    ({"from": "function_call", "value": '{"name": "f", "arguments": "[1, 2]"}'}, "[]", "must be a JSON object"),
    ({"from": "gpt", "value": "x"}, '[{"name": "f",', "has tools that are not valid JSON"),
], ids=["truncated JSON", "no name", "arguments not an object", "bad tools"])
def test_bad_tool_data_names_the_source_and_record(tmp_path, turn, tools, why):
    path = write_sharegpt(tmp_path, turn, tools)
    with pytest.raises(DataError, match=rf"^{path}: record 2 .*{why}") as caught:
        read_and_encode(tmp_path, "qwen2.5", path, "sharegpt")
    assert "\n" not in str(caught.value)


def test_templates_that_cannot_show_tool_data_refuse_in_one_line():
    messages = [{"role": "user", "content": "Area?"},
                {"role": "assistant", "content": "", "tool_calls": '[{"name": "calculate_area", "arguments": {}}]'},
                {"role": "tool", "content": "15"}, {"role": "assistant", "content": "15."}]
    with pytest.raises(DataError, match=r"^the alpaca template has no way to show tools, tool calls or tool results"):
        encode(messages, family_tokenizer("chatml"), "alpaca", False)
    with pytest.raises(DataError, match=r"^the tokenizer's chat template does not show assistant turn 1 "):
        encode(messages, family_tokenizer("phi-3.5"), "tokenizer", False)  # it drops calls and tool turns
    two_calls = [messages[0], {**messages[1], "tool_calls": json.dumps([{"name": "a"}, {"name": "b"}])}]
    with pytest.raises(DataError, match=r"^the tokenizer's chat template cannot render a conversation: This model "
                                        r"only supports single tool-calls at once!$"):
        encode(two_calls, family_tokenizer("llama-3.1"), "tokenizer", False)
    labels = encode(messages, family_tokenizer("chatml"), "chatml", False)[1]
    assert any(label != IGNORE_INDEX for label in labels)


def test_chat_records_carry_reasoning_and_openais_older_function_call(tmp_path):
    records = [{"messages": [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue.", "reasoning_content": "The sky is blue."},
        {"role": "user", "content": "What is the area of a rectangle 5 by 3?"},
        {"role": "assistant", "content": None, "function_call": {"name": "calculate_area", "arguments":
                                                                 '{"shape": "rectangle", "dimensions": [5, 3]}'}},
        {"role": "function", "name": "calculate_area", "content": '{"area": 15}'},
        {"role": "assistant", "content": "15.", "reasoning_content": "The tool said 15."}]}]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    [(ids, labels)] = read_and_encode(tmp_path, "qwen3", path, "chat")
    assert target_runs(family_tokenizer("qwen3"), ids, labels) == [
        "Blue.<|im_end|>", hermes(RECTANGLE) + "<|im_end|>", "<think>\nThe tool said 15.\n</think>\n\n15.<|im_end|>"]


# ---- hand-written templates in the manner of others: text arguments, a call's own end token ---------------

DEEPSEEK_V3_LIKE = (  # joins the arguments as text; writes a reply after a tool's output without a header
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "{% elif m.tool_calls %}<｜Assistant｜><｜tool▁calls▁begin｜>{% for c in m.tool_calls %}<｜tool▁call▁begin｜>"
    "{{ c.function.name + '<｜tool▁sep｜>' + c.function.arguments }}<｜tool▁call▁end｜>{% endfor %}"
    "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    "{% else %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<｜Assistant｜>{% endif %}"
    "{{ m.content }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
HARMONY_LIKE_TOOLS = (  # gpt-oss's manner: a call ends with <|call|>, the last reply with <|return|>
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|start|>assistant to=functions."
    "{{ m.tool_calls[0].function.name }}<|channel|>commentary json<|message|>"
    "{{ m.tool_calls[0].function.arguments | tojson }}<|call|>"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}"
    "{% if loop.last %}<|return|>{% else %}<|end|>{% endif %}"
    "{% elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ m.content }}"
    "<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
SQUARE = [{"role": "user", "content": "Area of a 7 square?"},
          {"role": "assistant", "content": "", "tool_calls": '[{"name": "calculate_area", "arguments": '
                                                             '{"shape": "square", "dimensions": [7]}}]'},
          {"role": "tool", "content": '{"area": 49}'}, {"role": "assistant", "content": "49 square units."}]


def test_gpt_oss_records_carry_their_thinking(tmp_path):
    """Records as gpt-oss's fine-tuning data has them (HuggingFaceH4/Multilingual-Thinking): the reasoning in
    `thinking`, null on the other turns; gpt-oss's published template shows it in the analysis channel."""
    record = {"messages": [
        {"role": "system", "content": "reasoning language: French", "thinking": None},
        {"role": "user", "content": "Name a color.", "thinking": None},
        {"role": "assistant", "content": "Blue.", "thinking": "The sky is blue."}]}
    path = tmp_path / "thinking.jsonl"
    path.write_text(json.dumps(record) + "\n")
    [(ids, labels)] = read_and_encode(tmp_path, "gpt-oss", path, "chat")
    assert target_runs(family_tokenizer("gpt-oss"), ids, labels) == [
        "<|channel|>analysis<|message|>The sky is blue.<|end|><|start|>assistant<|channel|>final<|message|>Blue."
        "<|return|>"]


def test_a_template_that_joins_arguments_as_text_gets_text():
    assert_targets(with_template("deepseek-r1", DEEPSEEK_V3_LIKE), SQUARE, [
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculate_area<｜tool▁sep｜>{"shape": "square", "dimensions": [7]}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        "49 square units.<｜end▁of▁sentence｜>"])  # no header after the output: it starts after <｜tool▁output▁end｜>


def test_a_call_with_its_own_end_token_stops_there():
    assert_targets(with_template("harmony", HARMONY_LIKE_TOOLS), SQUARE, [
        ' to=functions.calculate_area<|channel|>commentary json<|message|>{"shape": "square", "dimensions": [7]}'
        "<|call|>", "<|channel|>final<|message|>49 square units.<|return|>"])
