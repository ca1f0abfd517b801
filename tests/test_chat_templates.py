"""Published chat templates, rendered once per conversation: every assistant turn (its reply, reasoning where the
template shows it, and its end-of-turn token) is a target, and nothing else is.

The templates are the models' own (tests/fixtures/chat_templates/*.jinja, verbatim below a comment naming their
source), and a few small hand-written ones where a test needs a template that hides a turn, or works in a manner
none of those has (generation markers, harmony's segments in small). Each runs on a tiny byte-level BPE trained
here, with the family's control tokens added as special tokens (Qwen's <think> and <tool_call> as plain added
tokens, as Qwen ships them) and bos/eos as the family has.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from datasets.fingerprint import Hasher
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from qlora_fsdp.data.chat_turns import as_the_template_wants, render_chat, turn_markers
from qlora_fsdp.data.pipeline import Tokenize
from qlora_fsdp.data.templates import IGNORE_INDEX, encode, prompt_ids
from qlora_fsdp.data.tool_calls import template_messages, tools_of
from qlora_fsdp.errors import DataError
from qlora_fsdp.tools.adapter_sampling import readable_reply

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
CORPUS = ["You are terse. Name a color. Blue. Another one? Green, like grass. The sky is blue. Grass is green.",
          "What is the area of a rectangle 5 by 3? The rectangle covers 15 square units. calculate_area shape",
          "dimensions circle square number string object array type function name arguments parameters",
          "<|im_start|>system\n<|im_start|>user\n<|im_start|>assistant\n<start_of_turn>model\n<|assistant|>\n"]


@dataclass(frozen=True)
class Family:
    template: str | None  # fixture file; None: no chat template (the named templates are used)
    specials: tuple[str, ...]  # control tokens, special as in the model's tokenizer
    bos: str | None
    eos: str
    added: tuple[str, ...] = ()  # added tokens that are not special (Qwen's)


QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
FAMILIES = {
    "llama-3.1": Family("llama-3.1-8b-instruct.jinja", ("<|begin_of_text|>", "<|end_of_text|>",
                        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
                        bos="<|begin_of_text|>", eos="<|eot_id|>"),
    "qwen2.5": Family("qwen2.5-7b-instruct.jinja", QWEN_SPECIALS, bos=None, eos="<|im_end|>",
                      added=("<tool_call>", "</tool_call>")),
    "qwen3": Family("qwen3-0.6b.jinja", QWEN_SPECIALS, bos=None, eos="<|im_end|>",
                    added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                           "</think>")),
    "mistral-nemo": Family("mistral-nemo-instruct-2407.jinja", ("<unk>", "<s>", "</s>", "[INST]", "[/INST]",
                           "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                           "[TOOL_CALLS]"), bos="<s>", eos="</s>"),
    "gemma-2": Family("gemma-2-2b-it.jinja", ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
                      bos="<bos>", eos="<eos>"),
    "phi-3.5": Family("phi-3.5-mini-instruct.jinja", ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>",
                      "<|system|>", "<|end|>", "<|user|>"), bos="<s>", eos="<|endoftext|>"),
    "deepseek-r1": Family("deepseek-r1-distill-qwen-32b.jinja", ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                          "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                          "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>",
                          "<｜tool▁output▁end｜>"), bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>",
                          added=("<think>", "</think>")),
    "gemma-4": Family("gemma-4-31b-it.jinja", ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|channel>",
                      "<channel|>", "<|think|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
                      "<|tool_response>", "<tool_response|>", '<|"|>'), bos="<bos>", eos="<turn|>"),
    "glm-4.7": Family("glm-4.7-flash.jinja", ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>",
                      "<|assistant|>", "<|observation|>"), bos=None, eos="<|endoftext|>",
                      added=("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                             "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>")),
    "deepseek-v3.1": Family("deepseek-v3.1.jinja", ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                            "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                            "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>",
                            "<｜tool▁output▁end｜>"),
                            bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", added=("<think>", "</think>")),
    "chatml": Family(None, ("<s>", "</s>", "<|im_start|>", "<|im_end|>"), bos="<s>", eos="</s>"),
    "gpt-oss": Family("gpt-oss-20b.jinja", ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                      "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>"), bos=None, eos="<|return|>"),
    "harmony": Family(None, ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"), bos=None,
                      eos="<|return|>"),  # gpt-oss's control tokens, for a hand-written template below
}

SYSTEM = {"role": "system", "content": "You are terse."}
CHAT = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Green, like grass."}]


def published_template(name: str) -> str:
    """The fixture without its leading source comment: the template exactly as the model publishes it."""
    text = (FIXTURES / name).read_text()
    return text[text.index("#}\n") + 3 :] if text.startswith("{#") else text


@functools.cache
def family_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """Shared between tests: copy it before changing it."""
    family = FAMILIES[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(family.specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer=trainer)
    tok.add_tokens([AddedToken(token, special=False, normalized=False) for token in family.added])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=family.bos, eos_token=family.eos)
    if family.template:
        tokenizer.chat_template = published_template(family.template)
    return tokenizer


def with_template(name: str, template: str) -> PreTrainedTokenizerFast:
    tokenizer = copy.deepcopy(family_tokenizer(name))
    tokenizer.chat_template = template
    return tokenizer


def target_runs(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The target tokens, decoded run by contiguous run."""
    runs: list[list[int]] = [[]]
    for token, label in zip(ids, labels, strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            runs[-1].append(token)
        elif runs[-1]:
            runs.append([])
    return [tokenizer.decode(run) for run in runs if run]


def assert_targets(tokenizer, messages, expected: list[str], template: str = "tokenizer", tools=None) -> list[int]:
    """Exactly `expected` is trained on, run by run, and nothing else; the ids are the template's text."""
    ids, labels = encode(messages, tokenizer, template, False, tools)
    assert target_runs(tokenizer, ids, labels) == expected
    n_expected = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in expected)
    assert sum(label != IGNORE_INDEX for label in labels) == n_expected
    if template == "tokenizer":
        markers = turn_markers(tokenizer, tokenizer.get_chat_template(None, tools_of(tools) or None))
        chat = as_the_template_wants(template_messages(messages), markers)
        assert tokenizer.decode(ids) == render_chat(chat, tokenizer, tools=tools_of(tools))
    return ids


# ---- every published template, multi-turn -------------------------------------------------------------

EXPECTED = {  # (conversation, target runs, text that must be rendered yet never trained on)
    "llama-3.1": ([SYSTEM, *CHAT], ["Blue.<|eot_id|>", "Green, like grass.<|eot_id|>"],
                  "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are terse.<|eot_id|>"),
    "qwen2.5": (CHAT, ["Blue.<|im_end|>", "Green, like grass.<|im_end|>"],
                "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>"),
    "qwen3": ([SYSTEM, *CHAT], ["Blue.<|im_end|>", "<think>\n\n</think>\n\nGreen, like grass.<|im_end|>"],
              "<|im_start|>system\nYou are terse.<|im_end|>"),
    "mistral-nemo": (CHAT, ["Blue.</s>", "Green, like grass.</s>"], "[INST]Another one?[/INST]"),
    "gemma-2": (CHAT, ["Blue.<end_of_turn>", "Green, like grass.<end_of_turn>"],
                "<start_of_turn>user\nAnother one?<end_of_turn>\n<start_of_turn>model\n"),
    "phi-3.5": ([SYSTEM, *CHAT], ["Blue.<|end|>", "Green, like grass.<|end|>"],
                "<|system|>\nYou are terse.<|end|>\n<|user|>\nName a color.<|end|>\n<|assistant|>\n"),
    # thinking off: every turn opens '<｜Assistant｜></think>' (the header), the reply ends with the end of sentence
    "deepseek-v3.1": ([SYSTEM, *CHAT], ["Blue.<｜end▁of▁sentence｜>", "Green, like grass.<｜end▁of▁sentence｜>"],
                      "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Name a color.<｜Assistant｜></think>"),
}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_every_assistant_turn_is_a_target_and_nothing_else(family):
    tokenizer = family_tokenizer(family)
    messages, expected, context = EXPECTED[family]
    assert_targets(tokenizer, messages, expected)
    full = render_chat(messages, tokenizer)
    assert context in full  # headers, dates, default system prompts: rendered, and (above) never targets


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_prompt_ids_open_the_last_turn_as_training_rendered(family):
    """Generation's prompt for the last turn is the training ids up to that turn's first target."""
    tokenizer = family_tokenizer(family)
    messages = EXPECTED[family][0]
    if family == "mistral-nemo":  # its template shows a system message only when the last message is the user's
        assert messages[0]["role"] != "system"
    ids, labels = encode(messages, tokenizer, "tokenizer", False)
    last_turn = max(i for i in range(1, len(ids)) if labels[i] != IGNORE_INDEX and labels[i - 1] == IGNORE_INDEX)
    assert prompt_ids(messages[:-1], tokenizer, "tokenizer") == ids[:last_turn]


def test_mistral_nemo_shows_a_system_message_only_in_prompts():
    """A quirk of the published template, not of the masking: the system message goes into the last user turn
    only when that turn ends the conversation, so training text (ending with a reply) never shows it."""
    tokenizer = family_tokenizer("mistral-nemo")
    assert "You are terse." not in render_chat([SYSTEM, *CHAT], tokenizer)
    assert "[INST]You are terse.\n\nAnother one?[/INST]" in render_chat([SYSTEM, *CHAT[:3]], tokenizer)


REASONING = [  # the sky reasoning is an earlier turn's: Qwen3's template drops it
    ("field", {"reasoning_content": "The sky is blue."}, {"reasoning_content": "Grass is green."}),
    ("think tags", {"content": "<think>\nThe sky is blue.\n</think>\n\nBlue."},
     {"content": "<think>\nGrass is green.\n</think>\n\nGreen, like grass."}),
]


@pytest.mark.parametrize(("how", "first", "second"), REASONING, ids=[r[0] for r in REASONING])
def test_qwen3_trains_on_the_reasoning_it_shows(how, first, second):
    """Qwen3 renders an earlier turn without its reasoning; prefix rendering refused such chats, one rendering
    finds both turns."""
    messages = [SYSTEM, CHAT[0], {**CHAT[1], **first}, CHAT[2], {**CHAT[3], **second}]
    assert_targets(family_tokenizer("qwen3"), messages,
                   ["Blue.<|im_end|>", "<think>\nGrass is green.\n</think>\n\nGreen, like grass.<|im_end|>"])
    assert "The sky is blue." not in render_chat(template_messages(messages), family_tokenizer("qwen3"))


def test_qwen3_shows_every_reasoning_after_the_last_question():
    """Turns after the user's last question (a tool loop) keep their reasoning; each is trained on whole."""
    call = '[{"name": "calculate_area", "arguments": {"shape": "square", "dimensions": [7]}}]'
    messages = [CHAT[0], {"role": "assistant", "content": "", "reasoning_content": "A tool knows.", "tool_calls": call},
                {"role": "tool", "content": '{"area": 49}'},
                {"role": "assistant", "content": "Blue.", "reasoning_content": "The tool said so."}]
    assert_targets(family_tokenizer("qwen3"), messages, [
        '<think>\nA tool knows.\n</think>\n\n<tool_call>\n{"name": "calculate_area", "arguments": {"shape": '
        '"square", "dimensions": [7]}}\n</tool_call><|im_end|>',
        "<think>\nThe tool said so.\n</think>\n\nBlue.<|im_end|>"])


def test_gemma_refuses_a_system_turn_in_one_line():
    with pytest.raises(DataError, match=r"^the tokenizer's chat template cannot render a conversation: System role "
                                        r"not supported$"):
        encode([SYSTEM, *CHAT], family_tokenizer("gemma-2"), "tokenizer", False)


def test_reply_whitespace_trimmed_by_the_template_is_still_found():
    messages = [CHAT[0], {"role": "assistant", "content": "  Blue.\n"}, CHAT[2], CHAT[3]]
    assert_targets(family_tokenizer("llama-3.1"), messages, ["Blue.<|eot_id|>", "Green, like grass.<|eot_id|>"])
    assert_targets(family_tokenizer("qwen2.5"), messages, ["  Blue.\n<|im_end|>", "Green, like grass.<|im_end|>"])


# ---- hand-written templates: hidden turns, generation markers, thinking prompts ---------------------------

HIDES_EARLIER_REPLIES = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role }}\n"
                         "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MARKS_GENERATION = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
                    "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n"
                    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HARMONY_LIKE = ("{% for m in messages %}{% if m.role == 'assistant' %}{% if loop.last and m.reasoning_content %}"
                "<|start|>assistant<|channel|>analysis<|message|>{{ m.reasoning_content }}<|end|>{% endif %}"
                "<|start|>assistant<|channel|>final<|message|>{{ m.content }}"
                "{% if loop.last %}<|return|>{% else %}<|end|>{% endif %}"
                "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
OPENS_THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}"
                  "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def test_a_template_that_hides_an_assistant_turn_is_refused_in_one_line():
    tokenizer = with_template("qwen3", HIDES_EARLIER_REPLIES)
    with pytest.raises(DataError) as caught:
        encode(CHAT, tokenizer, "tokenizer", False)
    assert str(caught.value).startswith("the tokenizer's chat template does not show assistant turn 1 ")
    assert "\n" not in str(caught.value) and "data.template" in str(caught.value)
    assert_targets(tokenizer, CHAT[:2], ["Blue.<|im_end|>"])  # one turn it does show


def test_generation_markers_decide_the_targets():
    assert_targets(with_template("qwen3", MARKS_GENERATION), [SYSTEM, *CHAT],
                   ["Blue.<|im_end|>", "Green, like grass.<|im_end|>"])


def test_deepseek_r1_prompts_a_thinking_turn_its_training_text_never_shows():
    """Its prompt ends in '<｜Assistant｜><think>\\n'; every rendered turn drops the reasoning and opens with the
    bare '<｜Assistant｜>', which is where each target starts."""
    tokenizer = family_tokenizer("deepseek-r1")
    messages = [SYSTEM, *CHAT[:3], {**CHAT[3], "content": "<think>\nGrass is green.\n</think>\n\nGreen, like grass."}]
    assert_targets(tokenizer, messages, ["Blue.<｜end▁of▁sentence｜>", "\n\nGreen, like grass.<｜end▁of▁sentence｜>"])
    opening = tokenizer("<｜Assistant｜><think>\n", add_special_tokens=False)["input_ids"]
    assert prompt_ids(messages[:-1], tokenizer, "tokenizer")[-len(opening) :] == opening


def test_gemma_4_trains_each_reply_with_its_turn_end_and_prompts_an_empty_thought_its_training_text_never_shows():
    """Gemma 4's turns are '<|turn>model\n' ... '<turn|>'; with thinking off its generation prompt adds an empty
    thought channel that no rendered turn has, so a prompt is the training ids up to the turn plus that channel."""
    tokenizer = family_tokenizer("gemma-4")
    messages = [SYSTEM, *CHAT]
    ids = assert_targets(tokenizer, messages, ["Blue.<turn|>", "Green, like grass.<turn|>"])
    assert "<|turn>system\nYou are terse.<turn|>\n<|turn>user\nName a color.<turn|>" in tokenizer.decode(ids)
    empty_thought = tokenizer("<|channel>thought\n<channel|>", add_special_tokens=False)["input_ids"]
    prompt = prompt_ids(messages[:-1], tokenizer, "tokenizer")
    opening = tokenizer("<|turn>model\n", add_special_tokens=False)["input_ids"]
    assert prompt[-len(empty_thought):] == empty_thought
    assert prompt[: -len(empty_thought)] == ids[: len(prompt) - len(empty_thought)]
    assert prompt[-len(empty_thought) - len(opening) : -len(empty_thought)] == opening


def test_glm_replies_end_with_the_token_that_opens_the_next_turn_and_the_last_one_too():
    """GLM-4.7-Flash's template gives a reply no end of its own: the next '<|user|>' closes it (a stop token of GLM's
    generation config), and the last reply has nothing after it. Each reply trains through that '<|user|>', the
    last one's written after it (as the template renders it once another turn follows), so the model learns to
    stop; past turns open with the template's '</think>' (thinking closed), which is trained on as the reply's."""
    tokenizer = family_tokenizer("glm-4.7")
    messages = [SYSTEM, *CHAT]
    ids, labels = encode(messages, tokenizer, "tokenizer", False)
    assert target_runs(tokenizer, ids, labels) == ["</think>Blue.<|user|>", "</think>Green, like grass.<|user|>"]
    rendered = render_chat(messages, tokenizer)
    assert rendered.startswith("[gMASK]<sop><|system|>You are terse.<|user|>Name a color.<|assistant|>")
    assert tokenizer.decode(ids) == rendered + "<|user|>"  # the template's text, the last reply closed
    with_next = render_chat([*messages, {"role": "user", "content": "More?"}], tokenizer)
    assert with_next.startswith(tokenizer.decode(ids))  # what the template writes once a user turn follows
    one_turn = encode(messages[:3], tokenizer, "tokenizer", False)
    assert target_runs(tokenizer, *one_turn) == ["</think>Blue.<|user|>"]  # a single reply learns to stop too
    assert tokenizer.decode(prompt_ids(messages[:-1], tokenizer, "tokenizer")).endswith("<|assistant|><think>")


def test_a_reply_in_segments_with_two_end_tokens():
    """gpt-oss's harmony format, in small: the last reply ends with <|return|>, earlier ones with <|end|>, and a
    reply with reasoning comes as an analysis segment, then a final one, each opened by '<|start|>assistant'."""
    tokenizer = with_template("harmony", HARMONY_LIKE)
    messages = [*CHAT[:3], {**CHAT[3], "reasoning_content": "Grass is green."}]
    assert_targets(tokenizer, messages, [
        "<|channel|>final<|message|>Blue.<|end|>",
        "<|channel|>analysis<|message|>Grass is green.<|end|><|start|>assistant<|channel|>final<|message|>Green, like "
        "grass.<|return|>"])


def test_a_generation_prompt_that_opens_thinking():
    """The prompt ends in '<think>\\n' but earlier turns show no reasoning: those start after the header's first
    line, the last after the whole header (the model's prompt), so training and generation agree."""
    tokenizer = with_template("qwen3", OPENS_THINKING)
    messages = [*CHAT[:3], {**CHAT[3], "reasoning_content": "Grass is green."}]
    ids = assert_targets(tokenizer, messages, ["Blue.<|im_end|>", "Grass is green.\n</think>\n\nGreen, like grass."
                                               "<|im_end|>"])
    assert ids[: len(prompt_ids(messages[:-1], tokenizer, "tokenizer"))] == prompt_ids(messages[:-1], tokenizer,
                                                                                        "tokenizer")


# ---- the encoder as datasets.map sees it ---------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3", "llama-3.1"])
def test_encoding_is_deterministic_and_leaves_the_map_hash_alone(family):
    tokenizer = family_tokenizer(family)
    tokenize = Tokenize(tokenizer, "tokenizer", False)
    before = Hasher.hash(tokenize)
    first = tokenize({"messages": [SYSTEM, *CHAT], "tools": ""})
    assert Hasher.hash(tokenize) == before == Hasher.hash(Tokenize(copy.deepcopy(tokenizer), "tokenizer", False))
    assert tokenize({"messages": [SYSTEM, *CHAT], "tools": ""}) == first


# ---- gpt-oss's published harmony template ----------------------------------------------------------------

def test_gpt_oss_trains_on_each_reply_with_its_channel_and_end_token():
    """The last reply ends with <|return|>, earlier ones with <|end|>; a reply's target starts after the
    '<|start|>assistant' that opens it (the generation prompt), so its channel header is learned."""
    tokenizer = family_tokenizer("gpt-oss")
    assert_targets(tokenizer, [SYSTEM, *CHAT], ["<|channel|>final<|message|>Blue.<|end|>",
                                                "<|channel|>final<|message|>Green, like grass.<|return|>"])
    full = render_chat([SYSTEM, *CHAT], tokenizer)
    assert "Reasoning: medium" in full  # the system message is the template's own; ours goes to the developer's
    assert "<|start|>developer<|message|># Instructions\n\nYou are terse.\n\n<|end|>" in full


def test_gpt_oss_trains_on_the_reasoning_of_the_last_reply():
    """gpt-oss's template reads a reply's reasoning from `thinking` and shows only the last reply's."""
    messages = [*CHAT[:3], {**CHAT[3], "reasoning_content": "Grass is green."}]
    assert_targets(family_tokenizer("gpt-oss"), messages, [
        "<|channel|>final<|message|>Blue.<|end|>",
        "<|channel|>analysis<|message|>Grass is green.<|end|><|start|>assistant<|channel|>final<|message|>Green, "
        "like grass.<|return|>"])


def test_gpt_oss_tool_call_ends_with_call_and_its_result_is_context():
    call = '[{"name": "calculate_area", "arguments": {"shape": "square", "dimensions": [7]}}]'
    tools = [{"type": "function", "function": {"name": "calculate_area", "description": "Area of a shape.",
                                                 "parameters": {"type": "object", "properties": {
                                                     "shape": {"type": "string", "description": "its name"}}}}}]
    messages = [CHAT[0], {"role": "assistant", "content": "", "tool_calls": call},
                {"role": "tool", "content": '{"area": 49}'}, {"role": "assistant", "content": "Blue."}]
    assert_targets(family_tokenizer("gpt-oss"), messages, [
        ' to=functions.calculate_area<|channel|>commentary json<|message|>{"shape": "square", "dimensions": [7]}'
        '<|call|>', "<|channel|>final<|message|>Blue.<|return|>"], tools=json.dumps(tools))


def test_a_harmony_reply_reads_as_its_messages():
    """What `generate` prints of a gpt-oss reply: the final answer, its reasoning and tool calls on lines naming their
    channel; a reply in any other format is the text without its special tokens."""
    tokenizer = family_tokenizer("gpt-oss")
    reply = ("<|channel|>analysis<|message|>The sky is blue.<|end|><|start|>assistant<|channel|>final<|message|>Blue."
             "<|return|>")
    assert readable_reply(tokenizer, tokenizer(reply)["input_ids"]) == "[analysis] The sky is blue.\nBlue."
    call = ' to=functions.calculate_area<|channel|>commentary json<|message|>{"shape": "square"}<|call|>'
    assert readable_reply(tokenizer, tokenizer(call)["input_ids"]) == '[commentary] {"shape": "square"}'
    qwen = family_tokenizer("qwen3")
    assert readable_reply(qwen, qwen("Blue.<|im_end|>")["input_ids"]) == "Blue."
