"""Tiny random vision-language checkpoints saved with their processors (as the hub ships them), and chat records
with images written as people write them: image parts in the content, LLaMA-Factory's `<image>` markers with an
`images` column, and text-only records mixed in."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image
from transformers import PreTrainedTokenizerFast

IMAGE_TOKEN = "<image>"
# a chat template that writes content parts (an image as the token the processor expands), as VLM templates do
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tiny_llava(out: Path, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Path:
    """LLaVA's layout: a CLIP vision tower (32-pixel images, 8-pixel patches: 16 image tokens), a two-layer
    projector, a Llama decoder under `language_model`; saved in bf16 with its LlavaProcessor. The tokenizer gains
    the image token and the chat template."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = CHAT_TEMPLATE
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    config = LlavaConfig(text_config=text, vision_config=vision, vision_feature_layer=-1,
                         vision_feature_select_strategy="default",
                         image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.to(torch.bfloat16).save_pretrained(out)
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
                   chat_template=CHAT_TEMPLATE, num_additional_image_tokens=1).save_pretrained(out)
    return out


GEMMA3_TEMPLATE = CHAT_TEMPLATE.replace("<image>", "<start_of_image>")  # Gemma's marker, which its processor expands


def write_tiny_gemma3(out: Path, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Path:
    """Gemma 3 4B-27B's layout (tests/families.py's tiny one: a SigLIP tower, 4 tokens an image, a Gemma 3 decoder
    with sliding windows) with its Gemma3Processor: the image marker becomes "\n\n", the begin-of-image token, the
    image's tokens, the end-of-image token and "\n\n"; an image's tokens attend to each other both ways."""
    from transformers import Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from tests.families import gemma3_multimodal

    marks = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer.add_special_tokens({"additional_special_tokens": list(marks.values())})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, extra_special_tokens=marks,
                                        **tokenizer.special_tokens_map)
    tokenizer.chat_template = GEMMA3_TEMPLATE
    config = gemma3_multimodal(tokenizer)
    config.image_token_id = tokenizer.convert_tokens_to_ids(marks["image_token"])
    config.boi_token_index = tokenizer.convert_tokens_to_ids(marks["boi_token"])
    config.eoi_token_index = tokenizer.convert_tokens_to_ids(marks["eoi_token"])
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # transformers starts the projection at zero, where the images would change nothing
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    model.to(torch.bfloat16).save_pretrained(out)
    Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), tokenizer=tokenizer,
                    chat_template=GEMMA3_TEMPLATE, image_seq_length=4).save_pretrained(out)
    return out


QWEN_MARKS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
QWEN_TEMPLATE = CHAT_TEMPLATE.replace("<image>", "".join(QWEN_MARKS[:3]))  # Qwen's: the pad token is expanded


def write_tiny_qwen2_5_vl(out: Path, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Path:
    """Qwen2.5-VL's layout: a windowed ViT over 14-pixel patches merged 2x2 into one token (a 56-pixel square is 4
    tokens), a Qwen2 decoder with rotary positions over 3 axes (`mrope_section`), its head tied to the embeddings as
    in the 3B (the whole config says so, not its text config). Saved as the hub ships it: the
    image processor's config naming the processor, the tokenizer and the chat template (transformers builds the
    video processor only with torchvision)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_MARKS)})
    tokenizer.chat_template = QWEN_TEMPLATE
    marks = {mark: tokenizer.convert_tokens_to_ids(mark) for mark in QWEN_MARKS}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rope_parameters": rope, "initializer_range": 0.1,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
              "fullatt_block_indexes": [1]}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=marks["<|image_pad|>"],
                              video_token_id=marks["<|video_pad|>"], vision_start_token_id=marks["<|vision_start|>"],
                              vision_end_token_id=marks["<|vision_end|>"], tie_word_embeddings=True)  # as 3B
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(out)
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)
    images.processor_class = "Qwen2_5_VLProcessor"
    images.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    return out


def write_tiny_qwen3_vl(out: Path, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Path:
    """Qwen3-VL's layout: a ViT over 16-pixel patches merged 2x2 (a 64-pixel square is 4 tokens) whose first two
    blocks' merged features are added to the first two decoder layers' image tokens (deepstack), a Qwen3 decoder
    with interleaved 3-axis rotary positions; saved as the hub ships it (see write_tiny_qwen2_5_vl)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_MARKS)})
    tokenizer.chat_template = QWEN_TEMPLATE
    marks = {mark: tokenizer.convert_tokens_to_ids(mark) for mark in QWEN_MARKS}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_parameters": rope,
            "initializer_range": 0.1, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
              "deepstack_visual_indexes": [0, 1], "initializer_range": 0.1}
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=marks["<|image_pad|>"],
                           video_token_id=marks["<|video_pad|>"], vision_start_token_id=marks["<|vision_start|>"],
                           vision_end_token_id=marks["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    Qwen3VLForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(out)
    images = Qwen2VLImageProcessorPil(min_pixels=64 * 64, max_pixels=128 * 128, patch_size=16, merge_size=2,
                                      temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    images.processor_class = "Qwen3VLProcessor"
    images.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    return out


MLLAMA_TEMPLATE = CHAT_TEMPLATE.replace("<image>", "<|image|>")


def write_tiny_mllama(out: Path, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Path:
    """Llama 3.2 Vision's layout: an image is one <|image|> token; the text reads it through cross-attention layers
    (here the second of three) over the tiled vision tower's states (28-pixel tiles, at most 2 an image, 4 patches and
    a class token each), gated by tanh gates the test sets away from transformers' zero init."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaProcessor
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": ["<|image|>", "<|python_tag|>"]})
    tokenizer.chat_template = MLLAMA_TEMPLATE
    text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "cross_attention_layers": [1],
            "initializer_range": 0.1, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
              "attention_heads": 2, "image_size": 28, "patch_size": 14, "max_num_tiles": 2,
              "intermediate_layers_indices": [0], "vision_output_dim": 64, "initializer_range": 0.1,
              "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]]}
    config = MllamaConfig(text_config=text, vision_config=vision,
                          image_token_index=tokenizer.convert_tokens_to_ids("<|image|>"))
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(config)
    with torch.no_grad():  # transformers starts the gates at zero, where the images would change nothing
        for name, parameter in model.named_parameters():
            if name.endswith("_gate"):
                parameter.fill_(0.8)
    model.to(torch.bfloat16).save_pretrained(out)
    images = MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=2)
    MllamaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=MLLAMA_TEMPLATE).save_pretrained(out)
    return out


def write_image_records(folder: Path) -> Path:
    """Chat records, a JSON line each: images as content parts (one or two), LLaMA-Factory's markers, text only."""
    folder.mkdir(parents=True, exist_ok=True)
    colours = {"red": (220, 20, 20), "green": (20, 200, 40), "blue": (30, 40, 230), "yellow": (230, 220, 20)}
    generator = torch.Generator().manual_seed(7)
    for index, (name, rgb) in enumerate(colours.items()):
        width, height = 40 + 8 * index, 30 + 4 * index
        # the colour, with noise that differs across the image: every patch (so every image token) differs
        noise = torch.randint(0, 96, (height, width, 3), generator=generator)
        pixels = (torch.tensor(rgb).clamp(max=159) + noise).to(torch.uint8).numpy()
        Image.fromarray(pixels, "RGB").save(folder / f"{name}.png")

    def part(name: str) -> dict:
        return {"type": "image", "image": f"{name}.png"}

    def text(value: str) -> dict:
        return {"type": "text", "text": value}

    records = [
        {"messages": [{"role": "user", "content": [part(name), text("What colour is this?")]},
                      {"role": "assistant", "content": [text(f"It is {name}.")]}]} for name in colours
    ] + [
        {"messages": [{"role": "user", "content": [part("red"), text("and"), part("blue"), text("Which is warmer?")]},
                      {"role": "assistant", "content": [text("The red one.")]}]},
        {"messages": [{"role": "user", "content": "<image>Name the colour."},
                      {"role": "assistant", "content": "Green."}], "images": ["green.png"]},
        {"messages": [{"role": "user", "content": "Name a warm colour."},
                      {"role": "assistant", "content": "Orange."}]},
        {"messages": [{"role": "user", "content": "Name a cold colour."},
                      {"role": "assistant", "content": "Blue."}]},
    ]
    path = folder / "images.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
