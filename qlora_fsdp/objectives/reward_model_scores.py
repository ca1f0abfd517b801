"""A trained reward model (the adapter folder of a train.objective reward run) as one of GRPO's reward functions.

`grpo.rewards: [{function: reward_model, options: {adapter: outputs/rm/adapter}}]`. Each rank loads the reward
model whole, unsharded, on its own device, 4-bit as it trained (so it must fit on one GPU beside the policy's
shard: a reward model smaller than the policy, as is usual), the first time it scores. A completion is scored as
the reward run scored its pairs: its prompt and the completion rendered with that run's template, its head on the
last token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from qlora_fsdp.config import Config, load_config
from qlora_fsdp.config.schema import Template
from qlora_fsdp.data.batching import Sample, collate
from qlora_fsdp.data.pipeline import run_template
from qlora_fsdp.data.sources import message
from qlora_fsdp.data.templates import encode
from qlora_fsdp.data.tool_calls import Message
from qlora_fsdp.distributed import DistInfo
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.loading.adapter import REWARD_TASK, TRAINING_CONFIG, load_adapter_into
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.losses.forward import ForwardLoss
from qlora_fsdp.precision import describe_device
from qlora_fsdp.run.description import describe_run


def as_messages(value: Any, role: str) -> list[Message]:
    """A prompt or completion as GRPO hands it over (text, or a list of role/content messages) -> messages."""
    if isinstance(value, str):
        return [message(role, value)]
    return [message(turn["role"], turn.get("content") or "") for turn in value]


def reward_run_config(adapter_dir: Path) -> Config:
    """The reward run's settings, from its adapter folder; a ConfigError in one line where it is none."""
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file() or not (adapter_dir / TRAINING_CONFIG).is_file():
        raise ConfigError(f"reward function reward_model: {adapter_dir} is not an adapter folder written by "
                          "train.py (adapter_config.json and training_config.yaml); give options {adapter: "
                          "OUTPUT_DIR/adapter} of a train.objective reward run")
    if json.loads(config_file.read_text()).get("task_type") != REWARD_TASK:
        raise ConfigError(f"reward function reward_model: {adapter_dir} is not a reward model's adapter (its "
                          f"task_type is not {REWARD_TASK}); train one with train.objective: reward")
    return load_config(str(adapter_dir / TRAINING_CONFIG), [], saved_by_a_run=True)


class RewardModelScores:
    """GRPO's reward function for a trained reward model: one score a completion."""

    def __init__(self, adapter_dir: Path, batch_size: int = 8) -> None:
        self.adapter_dir, self.batch_size = adapter_dir, batch_size
        self.cfg = reward_run_config(adapter_dir)
        self.loaded: tuple[nn.Module, PreTrainedTokenizerBase, Template, torch.device] | None = None
        self.__name__ = "reward_model"

    def load(self) -> tuple[nn.Module, PreTrainedTokenizerBase, Template, torch.device]:
        if self.loaded is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
                torch.device("cpu"))
            alone = DistInfo(rank=0, local_rank=0, world_size=1, device=device, mesh=cast(Any, None))
            self.cfg = describe_run(self.cfg, describe_device(device)).cfg
            model = build_sharded_model(self.cfg, alone, shard=False)
            load_adapter_into(model, self.adapter_dir)
            tokenizer = load_tokenizer(self.cfg)
            self.loaded = (model.eval(), tokenizer, run_template(self.cfg.data, tokenizer), device)
        return self.loaded

    @torch.no_grad()
    def __call__(self, prompts: list[Any], completions: list[Any], **_: Any) -> list[float | None]:
        model, tokenizer, template, device = self.load()
        samples = [Sample(*encode(as_messages(prompt, "user") + as_messages(completion, "assistant"), tokenizer,
                                  template, False))
                   for prompt, completion in zip(prompts, completions, strict=True)]
        length = self.cfg.data.context_length
        samples = [Sample(s.input_ids[:length], s.labels[:length]) for s in samples]
        scores: list[float | None] = []
        for start in range(0, len(samples), self.batch_size):
            batch = collate(samples[start : start + self.batch_size], tokenizer.pad_token_id)
            scores.extend(ForwardLoss().sequence_rewards(model, batch, device).float().tolist())
        return scores


def reward_model_function(options: dict[str, Any]) -> RewardModelScores:
    """The `reward_model` built-in from its options: {adapter: folder, batch_size: completions a forward}."""
    if "adapter" not in options:
        raise ConfigError("reward function reward_model needs options {adapter: OUTPUT_DIR/adapter} (a train.objective "
                          "reward run's adapter folder)")
    return RewardModelScores(Path(options["adapter"]), int(options.get("batch_size", 8)))
