"""Sampling from the 4-bit base + adapter, held as training holds it, with the prompt rendered by the template the
run trained with.

The model is built by the training code path: FSDP2 over every torchrun rank, with the recipe's CPU parameter
offload, so sampling fits wherever training fits (one process, unsharded, where the recipe trains so). Under FSDP2
each forward all-gathers one decoder layer at a time, so every rank must run the same forwards: all ranks get
the same prompt and seed, and HF's `synced_gpus` keeps them stepping together until the last one stops.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import peft
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from qlora_fsdp.config import Config, Template
from qlora_fsdp.config.schema import AttnImplementation
from qlora_fsdp.data.images import read_image, vision_inputs
from qlora_fsdp.data.pipeline import run_template
from qlora_fsdp.data.templates import prompt_ids
from qlora_fsdp.distributed import DistInfo, init_distributed
from qlora_fsdp.families import attention_needs
from qlora_fsdp.layers.generation_attention import generation_attention
from qlora_fsdp.loading.adapter import load_adapter_into
from qlora_fsdp.loading.checkpoint import load_hf_config, load_tokenizer
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.loading.image_side_training import trains_image_side
from qlora_fsdp.loading.sharding import uses_fsdp
from qlora_fsdp.loading.vision_encoder import load_processor, load_vision_encoder
from qlora_fsdp.precision import describe_device
from qlora_fsdp.run.description import describe_run
from qlora_fsdp.vision.image_embeddings import images_in_embeddings


@dataclass
class Sampling:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Generator:
    model: peft.PeftModel
    tokenizer: PreTrainedTokenizerBase
    template: Template
    info: DistInfo
    processor: Any = None  # a vision-language checkpoint's, where prompts come with images

    def prompt_inputs(self, prompt: str, system: str | None,
                      images: list[Path] | None) -> tuple[list[int], dict[str, torch.Tensor] | None]:
        """The prompt's ids (rendered as training rendered it) and, with images, their inputs: the processor's
        chat template shows the images before the prompt's text."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if not images:
            return prompt_ids(messages + [{"role": "user", "content": prompt}], self.tokenizer, self.template), None
        assert self.processor is not None, "load_generator(..., images=True) loads the processor"
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        text = self.processor.apply_chat_template(messages + [{"role": "user", "content": parts}], tokenize=False,
                                                  add_generation_prompt=True)
        pictures = [read_image(str(path), Path.cwd(), "--image") for path in images]
        out = self.processor(text=[text], images=pictures, add_special_tokens=False, return_tensors="pt")
        vision = vision_inputs(out)
        return out["input_ids"][0].tolist(), vision

    @property
    def is_main(self) -> bool:
        return self.info.is_main

    @torch.no_grad()
    def token_ids(self, prompt: str, sampling: Sampling, system: str | None = None,
                  images: list[Path] | None = None, streamer: BaseStreamer | None = None) -> list[int]:
        """The new tokens of one reply. A collective under FSDP: every rank calls it with the same arguments."""
        prompt_tokens, vision = self.prompt_inputs(prompt, system, images)
        ids = torch.tensor([prompt_tokens], device=self.info.device)
        torch.manual_seed(sampling.seed)  # the same draws on every rank, so the same tokens and the same forwards
        sample = sampling.temperature > 0
        with images_in_embeddings(self.model, vision, self.info.device):
            out = self.sample(ids, sampling, sample, streamer)
        release_root(self.model)
        return out[0, ids.shape[1]:].tolist()

    def sample(self, ids: torch.Tensor, sampling: Sampling, sample: bool,
               streamer: BaseStreamer | None = None) -> torch.Tensor:
        return self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=sampling.max_new_tokens,
            do_sample=sample, temperature=sampling.temperature if sample else None,
            top_p=sampling.top_p if sample else None, pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id, streamer=streamer,  # the studio's chat: each token as it comes
            use_cache=True,  # explicit, as training turned config.use_cache off: new tokens attend to cached K/V
            # a rank that reached EOS keeps running dummy forwards (and all-gathers) until every rank has: should
            # numerics ever differ between GPUs, no rank waits forever for another's gather
            synced_gpus=self.info.world_size > 1)

    def reply(self, prompt: str, sampling: Sampling, system: str | None = None,
              images: list[Path] | None = None, streamer: BaseStreamer | None = None) -> str:
        return readable_reply(self.tokenizer, self.token_ids(prompt, sampling, system, images, streamer))


# one message of gpt-oss's harmony format: its channel (the header may name a recipient and a content type), its text
HARMONY_MESSAGE = re.compile(r"<\|channel\|>(\w+)[^<]*<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|<\|call\|>|$)", re.S)


def readable_reply(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """A reply as a person reads it, special tokens dropped. A harmony reply (gpt-oss) is its messages, one a line:
    the final answer as it is, the others (reasoning, a tool call) after their channel's name; dropping the special
    tokens alone would run the headers into the text ("analysis...assistantfinalBlue.")."""
    messages = HARMONY_MESSAGE.findall(str(tokenizer.decode(ids, skip_special_tokens=False)))
    if not messages:
        return str(tokenizer.decode(ids, skip_special_tokens=True))
    return "\n".join(text if channel == "final" else f"[{channel}] {text}" for channel, text in messages)


def sampling_config(cfg: Config, offload: bool | None = None) -> Config:
    """The recipe as sampling runs it: no activation checkpointing (no backward pass to save for), and CPU
    parameter offload as the recipe says unless `offload` decides."""
    no_recompute = dataclasses.replace(cfg.activation_checkpointing, mode="off")
    fsdp = cfg.fsdp if offload is None else dataclasses.replace(cfg.fsdp, cpu_offload=offload)
    needs = attention_needs(load_hf_config(cfg))
    # a kernel of generation's own may come back (blockwise_generation), not a name a recipe can give
    attention = cast(AttnImplementation, generation_attention(cfg.model.attn_implementation, needs))
    model = dataclasses.replace(cfg.model, attn_implementation=attention)
    train = dataclasses.replace(cfg.train, compile=False)  # a KV cache changes shapes every token: recompiles
    return dataclasses.replace(cfg, activation_checkpointing=no_recompute, fsdp=fsdp, model=model, train=train)


def load_generator(cfg: Config, adapter_dir: Path | None, offload: bool | None = None,
                   images: bool = False) -> Generator:
    """The recipe's base in 4-bit with the adapter's weights, sharded and offloaded as training does it (see
    `sampling_config`); without an adapter, LoRA stays at its zero init, so replies are the base model's. With
    `images`, a vision-language checkpoint's processor and image side too."""
    cfg = sampling_config(cfg, offload)
    info = init_distributed(cfg.fsdp.shard_size, cfg.train.collective_timeout_minutes,
                            first_collective_timeout_s=cfg.train.first_collective_timeout_s)
    note_unsharded_fallback(cfg, info)
    cfg = describe_run(cfg, describe_device(info.device)).cfg
    model = build_sharded_model(cfg, info, shard=True, sampling=True)  # unsharded where uses_fsdp says so (one process)
    tokenizer = load_tokenizer(cfg)
    processor = None
    if images or trains_image_side(cfg):  # a trained image side's weights are in the adapter: built first
        processor = load_processor(cfg)
        load_vision_encoder(model, cfg, info.device)
    if adapter_dir is not None:
        load_adapter_into(model, adapter_dir)
        if (adapter_dir / "tokenizer_config.json").is_file():  # the tokenizer the run used, saved with it
            tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    model.eval()
    # PeftModel.generate calls the inner model's forward, past the FSDP root's hooks: make generate a forward of
    # the root, so embeddings, norm and head are gathered for it (a no-op for an unsharded model)
    register_fsdp_forward_method(model, "generate")
    return Generator(model, tokenizer, run_template(cfg.data, tokenizer), info, processor)


def note_unsharded_fallback(cfg: Config, info: DistInfo) -> None:
    """One process where the recipe trains sharded holds the whole 4-bit model on its device: say how not to."""
    if info.is_main and info.world_size < cfg.hardware.world_size and not uses_fsdp(cfg.fsdp, info.world_size):
        print(f"note: the recipe trains on {cfg.hardware.world_size} ranks; this one process holds the whole 4-bit "
              f"model on {info.device.type}. If it runs out of memory: torchrun --nproc_per_node "
              f"{cfg.hardware.gpus_per_node} scripts/generate.py ..., or --offload (one layer at a time on the GPU)",
              file=sys.stderr, flush=True)  # stdout carries only replies


def release_root(model: nn.Module) -> None:
    """Free the gathered root (embeddings, norm, head) between replies: the root may keep it gathered after a
    forward, which training wants (its backward follows at once) and sampling does not."""
    if isinstance(model, FSDPModule):
        model.reshard()
