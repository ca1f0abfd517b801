"""GRPO with tools and environments against TRL 1.16's own multi-turn rollouts (GRPOTrainer(tools=...,
environment_factory=...)), and the bad inputs a tool or an environment can bring.

The model's replies are scripted (a function of the rollout's context, the same on both sides, so a token layout
that differs makes every later reply differ too): tool calls in Qwen 2.5's Hermes format, two calls in one reply,
a call to a tool that raises, a reply that runs out of room. Everything else is each side's own: TRL's tool loop,
its tool-result tokens and masks, its rewards and loss; our rollouts, tool turns, masks, rewards and update. The
tokenizer carries Qwen 2.5's published chat template as TRL ships it (so TRL's response parser recognizes it)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from qlora_fsdp.config import GenerationConfig, GrpoConfig
from tests.helpers import build_tiny_checkpoint, full_grads, run_ranks, tiny_config

PROMPTS, GENERATIONS, MAX_COMPLETION = 4, 3, 400
SPECIALS = ["<|im_start|>", "<|im_end|>"]
SETTINGS = {  # TRL's GRPOConfig keys, each ours too
    "tools_dapo": dict(loss_type="dapo", max_tool_calling_iterations=3),
    "tools_grpo_masked": dict(loss_type="grpo", mask_truncated_completions=True),
    "environment_bnpo": dict(loss_type="bnpo", scale_rewards="batch"),
}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def lookup(key: str) -> str:
    """A value by its key.

    Args:
        key: The key.
    """
    return {"x": "forty"}[key]  # any other key raises: a failed call


class Counter_:
    """An environment: `step` moves a counter; the reward is where it ends."""

    def __init__(self) -> None:
        self.position = 0

    def reset(self, **record: Any) -> str:
        self.position = len(str(record.get("prompt"))) % 5
        return f" (start at {self.position})"

    def step(self, by: int) -> str:
        """Move the counter.

        Args:
            by: How far.
        """
        if by > 5:
            raise ValueError("too far")
        self.position += by
        return f"at {self.position}"

    def get_reward(self) -> float:
        return float(self.position % 4)


def make_counter() -> Counter_:
    return Counter_()


def call(name: str, **arguments: Any) -> str:
    import json
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


REPLIES = [
    call("add", a=3, b=4) + "<|im_end|>",
    "Let me look.\n" + call("lookup", key="x") + "<|im_end|>",
    call("lookup", key="y") + "\n" + call("add", a=1, b=2) + "<|im_end|>",  # one failing call of two
    "The answer is 7.<|im_end|>",
    call("step", by=2) + "<|im_end|>",
    call("step", by=9) + "<|im_end|>",  # the environment raises
    "I keep on thinking about it, " * 40,  # no end: cut by the room left
    "Done.<|im_end|>",
]


def scripted_reply(context: list[int], seen: Counter, tokenizer: Any) -> list[int]:
    """The reply to a context: chosen by the context and how often it was seen this call (a group's rows share a
    prompt). Questions 0 and 1 (rank 0's at world size 2) end after a round; the others call on for three."""
    key = (len(context), sum(context) % 9973)
    index = (sum(context) + 3 * seen[key]) % len(REPLIES)
    seen[key] += 1
    turns = sum(1 for token in context if token == tokenizer.convert_tokens_to_ids("<|im_end|>"))
    early = any(f"Question {p}:" in tokenizer.decode(context) for p in (0, 1))
    if turns >= (4 if early else 8):
        index = 3 + (index % 2) * 4  # a final answer
    elif not early:
        index = CALLING[index % len(CALLING)]
    return tokenizer(REPLIES[index], add_special_tokens=False)["input_ids"]


CALLING = [0, 1, 2, 4, 5]  # the replies that call a tool


def qwen_checkpoint(out: Path) -> Path:
    """The tiny checkpoint with a Qwen 2.5 tokenizer's chat tokens and TRL's copy of its published template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    build_tiny_checkpoint(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = qwen2_5_chat_template
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer))
    model.config.max_position_embeddings = 2048  # room for three rounds beside the tools' schemas
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def random_adapter(model_dir: Path, out: Path) -> Path:
    """A PEFT adapter with B non-zero (every LoRA path moves the loss)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=targets, init_lora_weights=False))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    model.save_pretrained(out)
    return out


def prompt_messages(p: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {p}: what is {p} plus {p + 3}?"}]


def conversation_reward(completions: list[list[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """Read off the conversation: tool results seen and failed, and the last reply's length."""
    out = []
    for messages in completions:
        tools = [m for m in messages if m["role"] == "tool"]
        failed = sum("error" in str(m["content"]) for m in tools)
        out.append(len(tools) - 2.0 * failed + len(messages[-1]["content"]) % 3)
    return out


class ScriptedGenerate:
    """Our side's transformers generate: the real call runs when `real` (its collectives, in the layout under
    test), then each row's new tokens are replaced by the scripted reply (padded, as HF pads a finished row)."""

    def __init__(self, model: Any, tokenizer: Any, real: bool) -> None:
        self.inner, self.tokenizer, self.real = model.generate, tokenizer, real
        self.rows_seen: list[int] = []

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 **kwargs: Any) -> torch.Tensor:
        if self.real:  # a few steps are the same collectives as all of them: every rank must make each call
            self.inner(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=min(max_new_tokens, 3),
                       **kwargs)
        seen: Counter = Counter()
        pad = self.tokenizer.pad_token_id
        new = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            reply = scripted_reply([i for i, m in zip(ids, mask, strict=True) if m], seen, self.tokenizer)
            new.append((reply + [pad] * max_new_tokens)[:max_new_tokens])
        self.rows_seen.append(len(new))
        return torch.cat([input_ids, torch.tensor(new, device=input_ids.device)], dim=1)


def our_rollouts_and_step(info, model_dir: Path, adapter: Path, packed: bool, real: bool,
                          layout: str | None = None) -> dict:
    """Each setting: our objective's multi-turn rollouts (the replies scripted), rewards, advantages and update on
    this rank's prompts (one a micro-batch): the token layout, the messages, the loss and every LoRA gradient."""
    from qlora_fsdp.agents.recipe import rollout_tools
    from qlora_fsdp.data.prompts import PromptData, Prompts
    from qlora_fsdp.data.templates import prompt_ids
    from qlora_fsdp.distributed.row_groups import RowSplit
    from qlora_fsdp.labels import IGNORE_INDEX
    from qlora_fsdp.loading.adapter import adapter_file_key, load_adapter_into
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.loading.fill import model_layout
    from qlora_fsdp.losses.forward import ForwardLoss
    from qlora_fsdp.objectives.base import RunParts
    from qlora_fsdp.objectives.grpo import Grpo
    from qlora_fsdp.rewards.functions import Reward

    out: dict = {}
    here = __name__
    for name, setting in SETTINGS.items():
        env = name.startswith("environment")
        tools = [f"{here}:lookup", f"{here}:add"] if not env else [f"{here}:add"]
        extra = {"environment": f"{here}:make_counter"} if env else {}
        if layout:
            extra["layout"] = layout
        cfg = tiny_config(model_dir, data={"packing": packed, "context_length": 1280, "format": "prompt",
                                           "micro_batch_size": 1, "template": "tokenizer"},
                          train={"objective": "grpo"})
        grpo = GrpoConfig(tools=tools, **{k: v for k, v in extra.items() if k != "layout"}, **setting)
        generation = GenerationConfig(num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION,
                                      temperature=0.7, layout=extra.get("layout", "auto"))
        cfg = dataclasses.replace(cfg, grpo=grpo, generation=generation)
        tokenizer = load_tokenizer(cfg)
        model = build_sharded_model(cfg, info)
        load_adapter_into(model, adapter)
        model.train()
        scripted = ScriptedGenerate(model, tokenizer, real)
        model.generate = scripted
        schemas = rollout_tools(cfg.grpo).schemas(None)
        messages = [prompt_messages(p) for p in range(PROMPTS)]
        ids = [prompt_ids(m, tokenizer, "tokenizer", schemas) for m in messages]
        data = PromptData(Prompts(ids, messages, {}, list(range(PROMPTS))), Prompts([], [], {}, []), "tokenizer")
        steps = Grpo(cfg, ForwardLoss(), rewards=[Reward("conversation", conversation_reward, 1.0)])
        steps.attach(RunParts(info, model, data, tokenizer.pad_token_id, None,
                              RowSplit(1, 0, info.rank, info.world_size), tokenizer))
        mine = range(info.rank * PROMPTS // info.world_size, (info.rank + 1) * PROMPTS // info.world_size)
        steps.current, steps.uses = steps.generate([[p] for p in mine]), 0
        generation = steps.current
        layout_rows = [(s.input_ids, [label != IGNORE_INDEX for label in s.labels]) for s in generation.samples]
        result = steps.step(1.0)
        grads = {adapter_file_key(key, model_layout(model)): grad for key, grad in full_grads(model).items()}
        out[name] = {"rows": layout_rows, "advantages": generation.advantages.tolist(), "loss": result.loss,
                     "grads": grads, "metrics": generation.metrics, "calls": len(scripted.rows_seen)}
    return out


def trl_rollouts_and_step(model_dir: Path, adapter: Path, tmp_path: Path) -> dict:
    """TRL 1.16's _generate_and_score_completions with its tool loop (its one-turn generation scripted) and
    compute_loss over the same micro-batches (one prompt's rollouts each), accumulated."""
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tests.helpers import transformers_nf4
    from tests.test_grpo import trl_accumulated

    out: dict = {}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for name, setting in SETTINGS.items():
        env = name.startswith("environment")
        model = PeftModel.from_pretrained(transformers_nf4(model_dir), adapter, is_trainable=True)
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=GENERATIONS,
                          gradient_accumulation_steps=PROMPTS, num_generations=GENERATIONS,
                          max_completion_length=MAX_COMPLETION, temperature=0.7, beta=0.0, use_cpu=True, bf16=False,
                          report_to="none", gradient_checkpointing=False, **setting)
        trainer = GRPOTrainer(model=model, reward_funcs=[conversation_reward], args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_list([{"prompt": prompt_messages(p)} for p in range(PROMPTS)]),
                              tools=[add] if env else [lookup, add], environment_factory=make_counter if env else None)
        for n, param in model.named_parameters():  # TRL casts a QLoRA adapter to bf16: fp32 here, as ours
            if n in weights:
                param.data = weights[n]

        def scripted(prompt_ids: list[list[int]], images: Any, fields: Any, num_generations: int,
                     has_tool_images: bool = False) -> tuple[list[list[int]], None]:
            seen: Counter = Counter()
            rows = list(prompt_ids)  # one a rollout: TRL repeats the prompts before generating
            made = []
            for row in rows:
                reply = scripted_reply(list(row), seen, tokenizer)[:MAX_COMPLETION]
                made.append(reply[: reply.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in reply
                            else reply)
            return made, None

        trainer._generate_single_turn = scripted
        trainer.current_gradient_accumulation_steps = PROMPTS
        model.train()
        inputs = [{"prompt": prompt_messages(p)} for p in range(PROMPTS) for _ in range(GENERATIONS)]
        batch = trainer._generate_and_score_completions(inputs)
        size = PROMPTS * GENERATIONS
        loss, grads = trl_accumulated(trainer, model, batch, size, PROMPTS)
        rows = []
        tool_mask = batch.get("tool_mask", torch.ones_like(batch["completion_mask"]))
        for i in range(size):
            prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
            kept = batch["completion_ids"][i] != tokenizer.pad_token_id  # the mask is off for a masked cut one
            completion = batch["completion_ids"][i][kept].tolist()
            trained = (batch["completion_mask"][i] * tool_mask[i])[kept].bool().tolist()
            rows.append((prompt + completion, [False] * len(prompt) + trained))
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("tools/")}
        out[name] = {"rows": rows, "advantages": batch["advantages"].tolist(), "loss": loss, "grads": grads,
                     "metrics": metrics}
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.slow
def test_multi_turn_rollouts_with_tools_and_an_environment_equal_trls(tmp_path):
    """Token layout (which tokens are the policy's), advantages, loss and every LoRA gradient against TRL's tool
    loop, at world sizes 1 (padded rows) and 2 (packed rows; the ranks' rollouts take different numbers of rounds,
    with the real decoding call run each round under FSDP so a rank that waits must still meet the gathers)."""
    model_dir = qwen_checkpoint(tmp_path / "model")
    adapter = random_adapter(model_dir, tmp_path / "adapter")
    one = run_ranks(our_rollouts_and_step, 1, model_dir, adapter, False, False, tmp_dir=tmp_path)[0]
    both = run_ranks(our_rollouts_and_step, 2, model_dir, adapter, True, True, "per_token", tmp_dir=tmp_path)
    trl = trl_rollouts_and_step(model_dir, adapter, tmp_path)
    for name in SETTINGS:
        reference = trl[name]
        masked = sum(1 for _, trained in reference["rows"] for t in trained if not t)
        assert masked > 0 and len(set(reference["advantages"])) > 3, name  # tool turns masked, rewards that differ
        assert reference["metrics"]["tools/call_frequency"] > 0.5, name
        for size, run in ((1, one), (2, both[0])):
            ours = run[name]
            local = len(ours["advantages"])
            assert ours["rows"] == reference["rows"][:local], (name, size)
            assert ours["advantages"] == pytest.approx(reference["advantages"][:local], abs=1e-6), (name, size)
            for key in ("tools/call_frequency", "tools/failure_frequency"):
                assert ours["metrics"][key] == pytest.approx(reference["metrics"][key], abs=1e-6), (name, key)
            print(f"{name} ws{size}: TRL {reference['loss']:.7f}, ours {ours['loss']:.7f}")
            assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-6), (name, size)
            assert ours["grads"].keys() == reference["grads"].keys()
            for key, grad in reference["grads"].items():
                # fp32 sums over ~1,200-token rows (the tools' schemas): a wrong mask moves them by far more
                assert relative(ours["grads"][key], grad) < 3e-5, (name, size, key)
        assert both[0][name]["rows"] + both[1][name]["rows"] == reference["rows"], name
        # ranks whose rollouts took different numbers of rounds made as many generate calls (a waiting rank decodes
        # a row it throws away; a round's rows split into calls the KV cache holds, their count agreed), and at
        # least as many as the rank with the most rounds needs
        rounds = [max(tool_turns(row) for row in rank[name]["rows"]) for rank in both]
        print(f"{name}: rounds by rank {rounds}, decoding calls by rank {[r[name]['calls'] for r in both]}")
        assert both[0][name]["calls"] == both[1][name]["calls"] >= 1 + max(rounds), name
    assert any(len(set(max(tool_turns(row) for row in rank[n]["rows"]) for rank in both)) > 1 for n in SETTINGS)


def tool_turns(row: tuple[list[int], list[bool]]) -> int:
    """The tool turns in a rollout: the runs of untrained tokens after its first trained one."""
    trained = row[1]
    first = trained.index(True) if True in trained else len(trained)
    return sum(1 for a, b in zip(trained[first:], trained[first + 1:], strict=False) if a and not b)


TOOL_FAMILIES = {"llama-3.1": "llama3", "qwen2.5": "hermes", "qwen3": "hermes", "mistral-nemo": "mistral",
                 "gpt-oss": "harmony"}


def test_each_familys_published_template_has_its_calls_read_back():
    """The format learnt from each published template; the calling turn it renders (two calls where the family
    writes several) read back to the same calls; templates without tools refused in one line."""
    from qlora_fsdp.agents.call_formats import parse_reply
    from qlora_fsdp.data.templates import conversation_ids
    from qlora_fsdp.errors import DataError
    from qlora_fsdp.objectives.tool_templates import tool_call_format
    from tests.test_chat_templates import family_tokenizer

    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}},
             {"type": "function", "function": {"name": "lookup", "arguments": {"key": "x"}}}]
    schemas = [get_json_schema(add), get_json_schema(lookup)]
    user = [{"role": "user", "content": "What is 3 plus 4?"}]
    for family, expected in TOOL_FAMILIES.items():
        tokenizer = family_tokenizer(family)
        form = tool_call_format(tokenizer, "tokenizer")
        assert form == expected, family
        several = calls if family in ("qwen2.5", "qwen3", "mistral-nemo") else calls[:1]
        before = tokenizer.decode(conversation_ids(user, tokenizer, "tokenizer", schemas, True))
        after = tokenizer.decode(conversation_ids([*user, {"role": "assistant", "content": "", "tool_calls": several}],
                                                  tokenizer, "tokenizer", schemas, False))
        assert after.startswith(before), family
        reply = parse_reply(after[len(before):], form, [tokenizer.eos_token])
        assert reply.tool_calls == several and not reply.malformed, (family, after[len(before):])
    for family in ("gemma-2", "phi-3.5"):
        with pytest.raises(DataError, match="shows no tool calls.*set data.template: chatml"):
            tool_call_format(family_tokenizer(family), "tokenizer")
    assert tool_call_format(family_tokenizer("chatml"), "chatml") == "hermes"


def get_json_schema(function: Any) -> dict[str, Any]:
    from transformers.utils import get_json_schema as schema

    return schema(function)


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    import time

    time.sleep(seconds)
    return "woke"


def test_bad_tools_environments_and_calls_fail_in_one_line_or_as_the_tools_message(tmp_path, monkeypatch):
    """At load: a tool without type hints or docstring, an environment without reset or whose factory raises, both
    environment keys. At run time nothing ends the run: a tool that hangs (in the main thread and in another), an
    environment method that raises and an unknown tool become failed calls with TRL's error message; a malformed
    call is not run and is counted."""
    import threading
    import time

    from qlora_fsdp.agents.call_formats import parse_reply
    from qlora_fsdp.agents.environments import load_environments
    from qlora_fsdp.agents.toolbox import load_tools, run_call
    from qlora_fsdp.config import Config
    from qlora_fsdp.config.validation import validate
    from qlora_fsdp.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "user_tools.py").write_text(
        "def untyped(a):\n    \"\"\"Add.\n\n    Args:\n        a: x\n    \"\"\"\n    return a\n"
        "def undocumented(a: int) -> int:\n    return a\n"
        "class NoReset:\n    def act(self, a: int) -> int:\n        \"\"\"Act.\n\n        Args:\n            a: x\n"
        "        \"\"\"\n        return a\n"
        "def no_reset():\n    return NoReset()\n"
        "def broken():\n    raise RuntimeError('no sandbox')\n")
    for spec, message in (("user_tools:untyped", "tool 'user_tools:untyped': Argument a is missing a type hint"),
                          ("user_tools.py:undocumented", "has no docstring"),
                          ("user_tools:absent", "has no function 'absent'")):
        with pytest.raises(ConfigError, match=message):
            load_tools([spec])
    for spec, message in (("user_tools:no_reset", "needs a reset"), ("user_tools:broken", "RuntimeError: no sandbox")):
        with pytest.raises(ConfigError, match=message):
            load_environments(GrpoConfig(environment=spec))
    cfg = Config()
    cfg.train.objective, cfg.data.format = "grpo", "prompt"
    cfg.grpo.environment, cfg.grpo.environments, cfg.generation.max_completion_length = "a:b", {"x": "a:b"}, 64
    with pytest.raises(ConfigError, match="set one of them"):
        validate(cfg)

    def call(name: str, **arguments: Any) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "arguments": arguments}}

    counter = Counter_()
    tools = {"slow": slow, "step": counter.step, "add": add}
    started = time.perf_counter()
    hung = run_call(tools, call("slow", seconds=30), 0.3)
    assert hung.failed and "ran past its 0.3 s" in hung.content and time.perf_counter() - started < 5
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(result=run_call(tools, call("slow", seconds=30), 0.3)))
    worker.start()
    worker.join(10)
    assert box["result"].failed and "ran past" in box["result"].content
    raised = run_call(tools, call("step", by=9), 5)
    assert raised.failed and raised.content == str({"error": "too far"})
    assert run_call(tools, call("nowhere"), 5).content == str({"error": "Tool nowhere not found."})
    assert run_call(tools, call("add", a=2, b=5), 5) == type(raised)("add", "7", False)

    async def later(a: int) -> int:
        """Awaited.

        Args:
            a: A value.
        """
        import asyncio

        await asyncio.sleep(0.01 if a < 10 else 30)
        return a * 2

    assert run_call({"later": later}, call("later", a=4), 5).content == "8"  # an async tool, awaited
    assert run_call({"later": later}, call("later", a=40), 0.3).failed  # and under the limit
    from examples.agent_tools import calculate

    shipped = load_tools([str(Path(__file__).parent.parent / "examples" / "agent_tools.py") + ":calculate"])
    assert shipped[0].name == "calculate" and calculate("(3 + 4) * 2") == "14"
    assert "only numbers" in run_call({"calculate": calculate}, call("calculate", expression="__import__('os')"),
                                      5).content
    from qlora_fsdp.rewards.builtin import math_answer

    # a rollout whose room ran out after a round ends on the tool's message
    conversation = [{"role": "assistant", "content": "It is 14; let me check."}, {"role": "tool", "content": "15"}]
    assert math_answer([conversation] * 2, ["#### 14", "#### 15"]) == [1.0, 0.0]  # a tool result is no answer
    bad = parse_reply('<tool_call>\n{"name": "add", "arguments": {"a": 3,\n</tool_call><|im_end|>', "hermes",
                      ["<|im_end|>"])
    assert bad.malformed == 1 and not bad.tool_calls and "<tool_call>" in bad.content


def test_prompts_are_read_with_their_environments_tools(tmp_path, monkeypatch):
    """A prompt file read as a run reads it: each record rendered with the tools of the environment its
    `environment` column names (and grpo.tools), plain text taken as the user's message, a prompt that is neither
    and unknown environments refused in one line."""
    import json

    from qlora_fsdp.agents.environments import EnvironmentError_
    from qlora_fsdp.config import Config
    from qlora_fsdp.data.prompts import load_prompt_data
    from qlora_fsdp.data.templates import prompt_ids
    from qlora_fsdp.errors import DataError
    from qlora_fsdp.objectives.tool_templates import prompt_tools
    from tests.test_chat_templates import family_tokenizer

    tokenizer = family_tokenizer("qwen2.5")
    path = tmp_path / "prompts.jsonl"

    def load(cfg: Config) -> Any:  # as a run reads them: the tools found beside the data (api.py)
        return load_prompt_data(tokenizer, cfg, tools=prompt_tools(tokenizer, cfg))

    def config(records: list[dict[str, Any]]) -> Config:
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
        cfg = Config()
        cfg.train.objective, cfg.data.format, cfg.data.path = "grpo", "prompt", str(path)
        cfg.data.context_length, cfg.data.eval_samples, cfg.data.template = 4096, 0, "tokenizer"
        cfg.generation.max_completion_length, cfg.grpo.tools = 64, [f"{__name__}:add"]
        cfg.grpo.environments = {"counter": f"{__name__}:make_counter", "plain": f"{__name__}:make_plain"}
        return cfg

    records = [{"prompt": prompt_messages(p), "environment": ["counter", "plain"][p % 2]} for p in range(4)]
    data = load(config(records))
    schemas = {"counter": [get_json_schema(add), get_json_schema(Counter_().step)],
               "plain": [get_json_schema(add), get_json_schema(Plain().echo)]}
    assert data.train.ids == [prompt_ids(r["prompt"], tokenizer, "tokenizer", schemas[r["environment"]])
                              for r in records]
    assert all('"name": "echo"' in tokenizer.decode(ids) for ids in data.train.ids[1::2])
    text = load(config([{"prompt": "What is 2 + 2?", "environment": "counter"}])).train
    assert text.prompts == [[{"role": "user", "content": "What is 2 + 2?"}]]  # plain text: the user's message
    assert text.ids == [prompt_ids(text.prompts[0], tokenizer, "tokenizer", schemas["counter"])]
    with pytest.raises(DataError, match="record 1: 'prompt' must be text or a list of chat messages"):
        load(config([{"prompt": 3, "environment": "counter"}]))
    with pytest.raises(EnvironmentError_, match="record 1: environment 'maze' is not among grpo.environments"):
        load(config([{"prompt": prompt_messages(0), "environment": "maze"}]))


class Plain:
    """A second environment: its one tool echoes."""

    def reset(self, **record: Any) -> None:
        return None

    def echo(self, text: str) -> str:
        """Echo.

        Args:
            text: What to say.
        """
        return text


def make_plain() -> Plain:
    return Plain()


@pytest.mark.slow
def test_a_tool_run_from_the_command_line_on_two_ranks(tiny_model_dir, tmp_path):
    """train.py with a tool and an environment, as a user runs it: plain-text prompts rendered with the tools
    (chatml), the environment's reset text in each rollout's prompt, its get_reward the only reward,
    TRL's tool metrics logged, the conversations in completions.jsonl."""
    from tests.helpers import run_cli

    out = tmp_path / "run"
    argv = ["--recipe", "tiny_cpu_grpo", f"model.path={tiny_model_dir}", f"train.output_dir={out}",
            "train.max_steps=2", "logging.plot=false", "data.template=chatml", "data.context_length=1024",
            "data.eval_samples=0", "generation.max_completion_length=12",
            "grpo.tools=[examples/agent_tools.py:calculate]",
            "grpo.environment=examples.agent_tools:make_counter", "grpo.max_tool_calling_iterations=2",
            "grpo.rewards=[]"]  # the environment's get_reward is the reward (the recipe's reads plain-text completions)
    results = run_cli(argv, 2, tmp_path)
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("tools/call_frequency", "tools/failure_frequency", "tools/malformed_frequency", "rewards/Counter"):
        assert all(key in r for r in steps), key
    assert all(0 < r["rewards/Counter"] <= 1 for r in steps)  # 1 / (1 + distance): the counter never reached 10
    sample = json.loads((out / "completions.jsonl").read_text().splitlines()[0])
    assert sample["prompt"][0]["role"] == "user"  # plain text taken as the user's message
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in sample["completions"])


def test_a_rounds_rows_are_split_into_calls_the_cache_holds():
    """A later round's rows differ in context and room left: a call's longest context and largest room fit the
    run's KV cache together (each row alone does), at most generation.rows a call, the rows kept in order."""
    from qlora_fsdp.objectives.rollouts import Decoder
    from tests.helpers import generation_plan

    decoder = Decoder.__new__(Decoder)  # calls_of reads the settings only
    decoder.plan, decoder.cache_tokens = generation_plan(), 100
    assert decoder.calls_of([[1] * 10, [1] * 8, [1] * 60], [40, 40, 40]) == [[0, 1, 2]]  # a first round: one call
    assert decoder.calls_of([[1] * 90, [1] * 30, [1] * 85, [1] * 80], [10, 70, 15, 15]) == [[0], [1], [2, 3]]
    decoder.plan = generation_plan(rows=2)
    assert decoder.calls_of([[1] * 10] * 5, [4] * 5) == [[0, 1], [2, 3], [4]]


def test_the_tool_demos_warm_start_teaches_the_call_its_rollouts_read_and_reward(real_model_dir):
    """make demo-tools: a conversation of its SFT data, rendered as training renders it on SmolLM2's tokenizer,
    trains a first reply that GRPO's parser reads back as a call of the calculator on the question's product; the
    call runs to the record's result, and the demo's reward pays for that call and not for a wrong one."""
    from transformers import AutoTokenizer

    from examples.agent_tools import calculate
    from examples.rewards import correct_tool_call
    from qlora_fsdp.agents.call_formats import parse_reply
    from qlora_fsdp.agents.toolbox import run_call
    from qlora_fsdp.data.pipeline import IGNORE_INDEX
    from qlora_fsdp.data.templates import encode
    from qlora_fsdp.objectives.tool_templates import tool_call_format

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    assert tool_call_format(tokenizer, "chatml") == "hermes"
    lines = Path("data/tool_calls.jsonl").read_text().splitlines()
    for record in map(json.loads, lines[:3]):
        ids, labels = encode(record["messages"], tokenizer, "chatml", False, record["tools"])
        first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
        end = next(i for i in range(first, len(labels)) if labels[i] == IGNORE_INDEX)
        reply = parse_reply(tokenizer.decode(ids[first:end]), "hermes", ["<|im_end|>"])
        expression = record["messages"][1]["tool_calls"][0]["function"]["arguments"]["expression"]
        assert [call["function"] for call in reply.tool_calls] == [
            {"name": "calculate", "arguments": {"expression": expression}}] and reply.malformed == 0
        result = run_call({"calculate": calculate}, reply.tool_calls[0], 5.0)
        answer = record["messages"][2]["content"]
        assert (result.content, result.failed) == (answer, False)
        right = [reply.message, {"role": "tool", "name": "calculate", "content": result.content}]
        wrong = [reply.message, {"role": "tool", "name": "calculate", "content": str(int(answer) + 1)}]
        assert correct_tool_call([right, wrong, [reply.message]], [answer] * 3) == [1.0, 0.0, 0.0]
