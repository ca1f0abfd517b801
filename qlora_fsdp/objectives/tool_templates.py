"""What GRPO's rollouts with tools read off the run's template, and what its prompts show of the tools: how the
template writes a call (learnt from a probe call it renders), the tokens of the tool results between two assistant
turns, and each record's tool schemas. Here, not in data/: data/ renders what it is given and never imports
agents/ (the tools and environments, user code)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from qlora_fsdp.agents.call_formats import PROBE_NAME, CallFormat, call_format
from qlora_fsdp.agents.environments import environment_of
from qlora_fsdp.agents.recipe import rollout_tools
from qlora_fsdp.config import Config, Template
from qlora_fsdp.data.pipeline import run_template
from qlora_fsdp.data.prompts import PromptTools
from qlora_fsdp.data.templates import conversation_ids
from qlora_fsdp.data.tool_calls import Message
from qlora_fsdp.errors import DataError


def tool_turn_ids(tool_messages: list[Message], tokenizer: PreTrainedTokenizerBase, template: Template) -> list[int]:
    """The tokens from the end of an assistant's calling turn (its end-of-turn token) to the next assistant turn's
    first: the tool results and the headers, as the template renders them. Learnt as TRL learns them: a one-call
    conversation rendered without and with the results, the first cut after its last EOS."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    calling: list[Message] = [{"role": "user", "content": "dummy"},
                              {"role": "assistant", "content": "", "tool_calls": [call]}]
    before = conversation_ids(calling, tokenizer, template, [], add_generation_prompt=False)
    after = conversation_ids(calling + tool_messages, tokenizer, template, [], add_generation_prompt=True)
    ends = [index for index, token in enumerate(before) if token == tokenizer.eos_token_id]
    before = before[: ends[-1] + 1] if ends else before
    if after[: len(before)] != before:
        raise DataError("the chat template renders a tool call's turn differently once its result follows, so the "
                        "result cannot be appended to the generated tokens; set data.template to chatml")
    return after[len(before):]


def tool_call_format(tokenizer: PreTrainedTokenizerBase, template: Template) -> CallFormat:
    """How the template writes a call (agents/call_formats.py), learnt from a probe call; a template that shows no
    tools is refused in one line."""
    if template == "chatml":
        return "hermes"
    call = {"type": "function", "function": {"name": PROBE_NAME, "arguments": {"x": 1}}}
    tool = {"type": "function", "function": {"name": PROBE_NAME, "description": "A probe.", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "description": "A value."}}}}}
    messages: list[Message] = [{"role": "user", "content": "probe"},
                               {"role": "assistant", "content": "", "tool_calls": [call]},
                               {"role": "tool", "content": "1"}]
    try:
        text = str(tokenizer.decode(conversation_ids(messages, tokenizer, template, [tool], False))) \
            if template == "tokenizer" else ""
    except DataError:
        text = ""
    form = call_format(text)
    if form is None:
        raise DataError(f"the {template} template shows no tool calls in a format GRPO can read back (Hermes "
                        "<tool_call>, Llama 3 JSON, gpt-oss, Mistral); set data.template: chatml")
    return form


def prompt_tools(tokenizer: PreTrainedTokenizerBase, cfg: Config) -> PromptTools | None:
    """What data/prompts.py renders of each record where GRPO's rollouts call tools (None where they do not): its
    prompt, plain text as the user's message (the chat template shows the tools, so GSM8K's `question` text works
    as it is), and the schemas of grpo.tools and of the record's environment. The run's template is checked to
    write calls first, so one that cannot is refused in one line before the model loads."""
    if not cfg.multi_turn_rollouts:
        return None
    tooling = rollout_tools(cfg.grpo)
    tool_call_format(tokenizer, run_template(cfg.data, tokenizer))

    def shown(record: dict[str, Any], where: str) -> tuple[Any, list[dict[str, Any]]]:
        prompt = record["prompt"]
        message = [{"role": "user", "content": prompt}] if isinstance(prompt, str) and prompt else prompt
        return message, tooling.schemas(environment_of(record, tooling.environments, where))
    return shown
