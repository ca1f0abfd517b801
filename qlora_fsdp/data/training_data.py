"""The one entry that reads a recipe's data as its objective reads it (data/kinds.py: what every kind offers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from qlora_fsdp.config import Config
from qlora_fsdp.data.images import load_image_data, records_have_images
from qlora_fsdp.data.kinds import TrainingData
from qlora_fsdp.data.pair_pipeline import load_pairs
from qlora_fsdp.data.pipeline import load_dataset
from qlora_fsdp.data.prompts import PromptTools, load_prompt_data
from qlora_fsdp.distributed import DistInfo


def load_training_data(tokenizer: PreTrainedTokenizerBase, cfg: Config, info: DistInfo | None,
                       processor: Callable[[], Any], tools: PromptTools | None = None) -> TrainingData[Any]:
    """SFT samples (with images where the records show some: then through `processor()`, the checkpoint's),
    preference pairs, or GRPO's prompts (showing `tools`: objectives/tool_templates.py's prompt_tools), as the
    objective's row of the table says it reads them."""
    kind = cfg.train.kind.data
    if kind == "prompts":
        return load_prompt_data(tokenizer, cfg, processor, tools)
    if kind == "pairs":
        return load_pairs(tokenizer, cfg, info)
    if records_have_images(cfg):
        return load_image_data(processor(), cfg)
    return load_dataset(tokenizer, cfg.data, cfg.train.seed, info)
