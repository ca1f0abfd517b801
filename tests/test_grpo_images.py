"""GRPO with images in the prompts (a vision-language policy), against transformers + bitsandbytes + PEFT and TRL 1.16:

- the prompts, encoded by the checkpoint's processor from TRL's dataset forms (an `images` column with bare image
  parts, or with text-only messages), equal TRL's own tokenization of them;
- the policy generates with its image side: greedy tokens equal transformers' generate on its own NF4 load with the
  adapter (PEFT), each prompt alone, while ours decode them together (left-padded, a static cache), at world size 1
  and at 2 in the split layout, the ranks' prompts differing in images and lengths;
- the update sees the images: from the same completions, TRL's `_generate_and_score_completions` and `compute_loss`
  (its processor's pixels, its forward of the VLM class) give our loss and every LoRA gradient, with the KL term
  (the reference: the adapter the run started from, frozen, as TRL's "ref" copy; over the images too), at world
  sizes 1 (padded rows) and 2 (packed rows).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from qlora_fsdp.config import GenerationConfig, GrpoConfig
from qlora_fsdp.tools.tiny_model import train_tokenizer
from tests.helpers import (
    REPO,
    full_grads,
    generation_plan,
    run_ranks,
    run_ranks_sequence,
    tiny_config,
    transformers_nf4,
)
from tests.test_grpo import ReplayedGenerate, fixed_completions, parity_reward, relative, trl_cut
from tests.vision_models import write_image_records, write_tiny_gemma3, write_tiny_qwen2_5_vl, write_tiny_qwen3_vl

SPLITS = ("qwen2_5_vl", "qwen3_vl")  # the families whose images context parallel splits (not Gemma 3's)
WRITERS = {"qwen2_5_vl": write_tiny_qwen2_5_vl, "qwen3_vl": write_tiny_qwen3_vl, "gemma3": write_tiny_gemma3}
GENERATIONS, MAX_NEW, TEMPERATURE, BETA = 2, 6, 0.8, 0.04  # 6: completions of different lengths in a group
GREEDY_TOKENS = 4


def prompt_records(folder: Path) -> tuple[Path, list[dict]]:
    """TRL's dataset forms: conversational prompts with an `images` column (bare image parts marking where, or
    text-only messages taking the pictures in front). Every prompt shows one: TRL 1.16 fails on a micro-batch of
    text-only rows among image ones (an empty pixel tensor reaches the model)."""
    write_image_records(folder)
    records = [
        {"prompt": [{"role": "user", "content": "What colour is this?"}], "images": ["red.png"]},
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                                 {"type": "image"}, {"type": "text", "text": "Which is warmer?"}]}],
         "images": ["yellow.png", "blue.png"]},
        {"prompt": [{"role": "user", "content": "Is it cold?"}], "images": ["blue.png"]},
        {"prompt": [{"role": "system", "content": "Answer in one word."},
                    {"role": "user", "content": "Colour?"}], "images": ["green.png"]},
    ]
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, records


def our_side(info, model_dir: Path, data: Path, adapter: Path, split: bool = False) -> dict:
    """Our recipe's path: the prompts through load_training_data (the processor), the 4-bit model with its image
    side, the adapter (written at world size 1 with LoRA B seeded away from zero); greedy generation of this rank's
    prompts; then the update from fixed completions (generate replaced: our rollout code runs around it). `split`:
    both ranks take every prompt, the update's rows split over them (context parallel)."""
    from qlora_fsdp.data.training_data import load_training_data
    from qlora_fsdp.distributed.row_groups import row_split
    from qlora_fsdp.loading.adapter import adapter_file_key, export_adapter, load_adapter_into
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.loading.fill import model_layout
    from qlora_fsdp.loading.vision_encoder import load_processor, load_vision_encoder
    from qlora_fsdp.losses.forward import ForwardLoss
    from qlora_fsdp.objectives.base import RunParts
    from qlora_fsdp.objectives.grpo import Grpo
    from qlora_fsdp.objectives.rollouts import decoding
    from qlora_fsdp.rewards.functions import Reward
    from tests.test_families import nonzero_lora_b

    packed = info.world_size > 1
    cfg = tiny_config(model_dir, data={"path": str(data), "context_length": 512, "eval_samples": 0,
                                       "micro_batch_size": 1, "packing": packed}, train={"objective": "grpo"},
                      fsdp={"context_parallel": info.world_size if split else 1})
    rows_split = row_split(cfg.fsdp.context_parallel)
    cfg = dataclasses.replace(cfg, grpo=GrpoConfig(beta=BETA), generation=GenerationConfig(
        num_generations=GENERATIONS, max_completion_length=MAX_NEW, temperature=TEMPERATURE))
    tokenizer = load_tokenizer(cfg)
    data = load_training_data(tokenizer, cfg, info, lambda: load_processor(cfg))
    assert data.has_images
    model = build_sharded_model(cfg, info)
    load_vision_encoder(model, cfg, info.device)
    if info.world_size == 1:
        nonzero_lora_b(model)
        export_adapter(model, tokenizer, adapter, str(model_dir), info.is_main, "")
    else:
        load_adapter_into(model, adapter)
    prompts = data.train
    n = len(prompts)
    takers, taker = rows_split.data_ranks, rows_split.data_rank
    mine = list(range(taker * n // takers, (taker + 1) * n // takers))
    layout = "split" if info.world_size > 1 else None
    greedy_grpo = generation_plan(**{**dataclasses.asdict(cfg.generation), "max_completion_length": GREEDY_TOKENS})
    rows = [prompts.ids[p] for p in mine]
    with decoding(model, tokenizer, greedy_grpo, info.device, info.world_size, len(rows), max(map(len, rows)),
                  layout=layout, greedy=True) as decode:
        greedy = decode(rows, images=[prompts.images_of(p) for p in mine]).ids
    model.train()
    replayed = fixed_completions(tokenizer.eos_token_id, n, GENERATIONS, MAX_NEW, torch.Generator().manual_seed(5))
    model.generate = ReplayedGenerate(prompts.ids, replayed, tokenizer.pad_token_id)
    # the run continues this adapter (model.adapter): the KL term's reference is it, frozen, as TRL's "ref" copy
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, adapter=str(adapter)))
    steps = Grpo(cfg, ForwardLoss(), rewards=[Reward("parity", parity_reward, 1.0)])
    steps.attach(RunParts(info, model, data, tokenizer.pad_token_id, None, rows_split, tokenizer))
    steps.current, steps.uses = steps.generate([[p] for p in mine]), 0
    result = steps.step(1.0)
    grads = {adapter_file_key(key, model_layout(model)): grad for key, grad in full_grads(model).items()}
    return {"prompt_ids": prompts.ids, "mine": mine, "greedy": greedy, "loss": result.loss, "grads": grads,
            "advantages": steps.current.advantages.tolist(), "rows": replayed}


def processor_of(model_dir: Path):
    """The checkpoint's processor (transformers' class; loaded as the recipe loads it, so without torchvision its
    video processor is left out), padding on the left as TRL loads one."""
    from qlora_fsdp.loading.vision_encoder import load_processor

    processor = load_processor(tiny_config(model_dir))
    processor.tokenizer.padding_side = "left"
    return processor


def trl_inputs(records: list[dict], folder: Path) -> list[dict]:
    from PIL import Image

    return [{"prompt": r["prompt"], "images": [Image.open(folder / name).convert("RGB") for name in r["images"]]}
            for r in records]


def reference_greedy(model_dir: Path, adapter: Path, prompt_ids: list[list[int]], inputs: list[dict]) -> list:
    """transformers' generate on its own NF4 load of the VLM class + PEFT, one prompt at a time, the processor's
    inputs for it (TRL's suppression of the image token)."""
    import transformers
    from peft import PeftModel

    from tests.test_vision import reference_extras

    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(transformers_nf4(model_dir, getattr(transformers, config.architectures[0])),
                                      adapter).eval()
    processor = processor_of(model_dir)
    out = []
    for ids, record in zip(prompt_ids, inputs, strict=True):
        vision = {}
        if record["images"]:
            text = processor.apply_chat_template(prepared(record), tokenize=False, add_generation_prompt=True)
            encoded = processor(text=[text], images=record["images"], add_special_tokens=False, return_tensors="pt")
            assert encoded["input_ids"][0].tolist() == ids
            vision = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")}
        tensor = torch.tensor([ids])
        extra = {**vision, **reference_extras(config, tensor)}
        made = model.generate(input_ids=tensor, attention_mask=torch.ones_like(tensor), **extra,
                              max_new_tokens=GREEDY_TOKENS, do_sample=False, suppress_tokens=[config.image_token_id],
                              pad_token_id=0)
        out.append(made[0, len(ids):].tolist())
    return out


def prepared(record: dict) -> list:
    from trl.data_utils import prepare_multimodal_messages

    return prepare_multimodal_messages(record["prompt"], images=record["images"] or None)


def trl_side(model_dir: Path, adapter: Path, inputs: list[dict], rows: list, tmp_path: Path) -> dict:
    """TRL 1.16's _generate_and_score_completions (rollout_func replaying the same completions, its own prompt
    tokenization) and compute_loss, one prompt's completions a micro-batch, split as TRL splits a generation with
    images (split_pixel_values_by_grid), accumulated."""
    import transformers
    from datasets import Dataset
    from peft import PeftModel
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

    from qlora_fsdp.loading.adapter import peft_adapter_key

    config = transformers.AutoConfig.from_pretrained(model_dir)
    processor = processor_of(model_dir)
    eos = processor.tokenizer.eos_token_id
    model = PeftModel.from_pretrained(transformers_nf4(model_dir, getattr(transformers, config.architectures[0])),
                                      adapter, is_trainable=True)
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    queue = {p: list(r) for p, r in enumerate(rows)}
    tokenized: list = []

    def rollout(prompts: list, trainer: object) -> dict:
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)  # TRL's own tokenization of its prompts
        picked = [tokenized.index(ids) if ids in tokenized else tokenized.append(ids) or len(tokenized) - 1
                  for ids in prompt_ids]
        made = [trl_cut(queue[p].pop(0), eos) for p in picked]
        return {"prompt_ids": prompt_ids, "completion_ids": made, "logprobs": [[0.0] * len(m) for m in made]}

    n = len(inputs)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=GENERATIONS,
                      gradient_accumulation_steps=n, num_generations=GENERATIONS, max_completion_length=MAX_NEW,
                      temperature=TEMPERATURE, beta=BETA, use_cpu=True, bf16=False, report_to="none",
                      gradient_checkpointing=False, remove_unused_columns=False)
    trainer = GRPOTrainer(model=model, reward_funcs=[parity_reward], args=args, processing_class=processor,
                          # only built from: the step below takes the inputs themselves (arrow cannot mix a
                          # message content of text with one of parts in one column)
                          train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "-"}]}] * n),
                          rollout_func=rollout)
    for name, param in model.named_parameters():  # TRL casts a QLoRA adapter to bf16: fp32 here, as ours
        if name in weights:
            param.data = weights[name]
    trainer.current_gradient_accumulation_steps = n
    model.train()
    batch = trainer._generate_and_score_completions([r for r in inputs for _ in range(GENERATIONS)])
    loss = 0.0
    for micro in split_tensor_dict(split_pixel_values_by_grid(batch), n):
        part = trainer.compute_loss(model, unsplit_pixel_values_by_grid(micro))
        part.backward()
        loss += part.item()
    grads = {peft_adapter_key(n, "default"): p.grad.detach().clone() for n, p in model.named_parameters()
             if p.requires_grad}
    return {"prompt_ids": tokenized, "loss": loss, "grads": grads, "advantages": batch["advantages"].tolist()}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_grpo_with_images_generates_and_updates_as_transformers_and_trl(family, tmp_path):
    model_dir = WRITERS[family](tmp_path / "model", train_tokenizer(REPO / "data" / "tiny_instruct.jsonl", 512))
    data, records = prompt_records(tmp_path / "data")
    adapter = tmp_path / "adapter"
    one = run_ranks(our_side, 1, model_dir, data, adapter, tmp_dir=tmp_path)[0]
    if family in SPLITS:  # and the update's rows split over the two ranks (context parallel), images crossing it
        ranks = run_ranks_sequence([(our_side, (model_dir, data, adapter)), (our_side, (model_dir, data, adapter,
                                                                                      True))], 2, tmp_path / "r",
                                   all_ranks=True)
        two, split = [rank[0] for rank in ranks], ranks[0][1]
    else:
        two, split = run_ranks(our_side, 2, model_dir, data, adapter, tmp_dir=tmp_path), None
    inputs = trl_inputs(records, tmp_path / "data")
    trl = trl_side(model_dir, adapter, inputs, one["rows"], tmp_path)
    assert one["prompt_ids"] == trl["prompt_ids"]  # TRL's own tokenization, in the order it first saw them
    greedy = reference_greedy(model_dir, adapter, one["prompt_ids"], inputs)
    assert one["greedy"] == greedy
    assert [ids for rank in two for ids in rank["greedy"]] == greedy  # each rank its own prompts, split layout
    print(f"{family}: TRL {trl['loss']:.7f}, ours ws1 {one['loss']:.7f}, ws2 {two[0]['loss']:.7f}")
    assert len(set(trl["advantages"])) > 2
    runs = [(one, one["advantages"]), (two[0], two[0]["advantages"])]
    if split is not None:  # both ranks every prompt: the first's completions, every advantage
        assert split["greedy"] == greedy and split["advantages"] == pytest.approx(one["advantages"], abs=1e-6)
        runs.append((split, split["advantages"]))
    for run, local in runs:
        assert local == pytest.approx(trl["advantages"][: len(local)], abs=1e-6)
        assert run["loss"] == pytest.approx(trl["loss"], rel=1e-5, abs=1e-6)
        assert run["grads"].keys() == trl["grads"].keys()
        for key, grad in trl["grads"].items():
            assert relative(run["grads"][key], grad) < 1e-5, key


def test_image_prompt_forms_and_bad_input_in_one_line(tiny_model_dir, tmp_path):
    """Every way a record gives its pictures (TRL's `image` column under another name through data.fields, `<image>`
    markers, a part holding its path) becomes the image's tokens and pixels; what cannot work is one line naming
    the file and record (or the checkpoint) before any weight is read."""
    from qlora_fsdp.data.training_data import load_training_data
    from qlora_fsdp.errors import ConfigError, DataError, ModelLoadError
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.loading.vision_encoder import load_processor

    model_dir = write_tiny_qwen2_5_vl(tmp_path / "model", train_tokenizer(REPO / "data" / "tiny_instruct.jsonl", 512))
    write_image_records(tmp_path / "data")

    def load(records: list[dict], model: Path = model_dir, grpo: dict | None = None, **data):
        path = tmp_path / "data" / "p.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        cfg = tiny_config(model, data={"path": str(path), "context_length": 512, "eval_samples": 0, **data},
                          train={"objective": "grpo"})
        cfg = dataclasses.replace(cfg, grpo=GrpoConfig(**(grpo or {})),
                                  generation=GenerationConfig(num_generations=2, max_completion_length=8))
        def shown(record: dict, where: str) -> tuple:  # the tools a run's prompts would show (none listed here)
            return record["prompt"], []
        tools = shown if cfg.grpo.calls_tools else None
        return load_training_data(load_tokenizer(cfg), cfg, None, lambda: load_processor(cfg), tools)

    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    forms = load([{"question": "Colour?", "picture": "red.png"},
                  {"question": "<image>What is this?", "picture": None, "images": ["blue.png"]},
                  {"question": [{"role": "user", "content": [{"type": "image", "image": "green.png"},
                                                            {"type": "text", "text": "And this?"}]}]}],
                 fields={"prompt": "question", "image": "picture"})
    prompts = forms.train
    assert all(vision is not None for vision in prompts.vision)
    for ids, vision in zip(prompts.ids, prompts.vision, strict=True):
        tokens = sum(token == image_token for token in ids)
        assert tokens and tokens * 4 == int(vision["image_grid_thw"].prod(-1).sum())  # 2x2 patches a token
    assert prompts.prompts[0][0]["content"][0] == {"type": "image"}  # the picture before the text, as TRL puts it
    assert forms.describe(512, "truncate").startswith("3 prompts (3 with images)")

    def refused(error: type, match: str, records: list[dict], **keys) -> None:
        with pytest.raises(error, match=match):
            load(records, **keys)

    refused(DataError, r"p.jsonl record 1: image missing.png cannot be read", [{"prompt": "?", "image": "missing.png"}])
    refused(DataError, r"p.jsonl record 2: an image part without an image, and no `images` left for it",
            [{"prompt": "?", "images": ["red.png"]},
             {"prompt": [{"role": "user", "content": [{"type": "image"}]}], "images": []}])
    refused(ModelLoadError, r"the data's records show images, but .* is a llama checkpoint without a vision tower",
            [{"prompt": "?", "image": "red.png"}], model=tiny_model_dir)
    tools = {"tools": ["examples/agent_tools.py:calculate"]}
    refused((DataError, ConfigError), r"prompts with images and grpo.tools / environments together are not built",
            [{"prompt": "?", "image": "red.png"}], grpo=tools)
