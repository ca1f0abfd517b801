"""Vision-language fine-tuning: chat records with images, the checkpoint's processor, its image side frozen and
replicated beside the sharded 4-bit decoder, against transformers + bitsandbytes NF4 (+ PEFT) on the same records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qlora_fsdp.tools.tiny_model import train_tokenizer
from tests.helpers import REPO, run_ranks, run_ranks_sequence, tiny_config
from tests.vision_models import (
    write_image_records,
    write_tiny_gemma3,
    write_tiny_llava,
    write_tiny_mllama,
    write_tiny_qwen2_5_vl,
    write_tiny_qwen3_vl,
)

SPLITS = ("llava", "qwen2_5_vl", "qwen3_vl")  # the families context parallel trains with images
WRITERS = {"llava": write_tiny_llava, "gemma3": write_tiny_gemma3, "qwen2_5_vl": write_tiny_qwen2_5_vl,
           "qwen3_vl": write_tiny_qwen3_vl, "mllama": write_tiny_mllama}


def tiny_vlm(root: Path, family: str) -> tuple[Path, Path]:
    model = WRITERS[family](root / "model", train_tokenizer(REPO / "data" / "tiny_instruct.jsonl", 512))
    return model, write_image_records(root / "data")


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> tuple[Path, Path]:
    return tiny_vlm(tmp_path_factory.mktemp("llava"), "llava")


def vision_config(model_dir: Path, data: Path, out: Path, lora: dict | None = None, **data_keys):
    return tiny_config(model_dir, data={"path": str(data), "format": "chat", "context_length": 128, "eval_samples": 2,
                                        **data_keys}, train={"output_dir": str(out)},
                       lora={"r": 4, "dropout": 0.0, **(lora or {})})


def our_side(info, model_dir: Path, data: Path, out: Path, adapter: Path | None, lora: dict | None = None) -> dict:
    """Our loss over every record (padded, then packed), with LoRA B seeded away from zero, and one step's LoRA
    gradients; at world size 2 rank 0 takes the text-only records and rank 1 the ones with images, so the ranks'
    forwards differ in images every step (no collective may depend on them). World size 1 runs the recipe without
    packing (transformers' sdpa kernel), 2 with it (the per-sample kernel, packed rows as one)."""
    from qlora_fsdp.config.loader import to_yaml
    from qlora_fsdp.data.batching import collate, collate_packed
    from qlora_fsdp.data.training_data import load_training_data
    from qlora_fsdp.distributed import all_reduce_sums
    from qlora_fsdp.distributed.grad_sync import sum_replicated_gradients
    from qlora_fsdp.loading.adapter import adapter_file_key, export_adapter
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.loading.fill import model_layout
    from qlora_fsdp.loading.vision_encoder import load_processor, load_vision_encoder
    from qlora_fsdp.losses.forward import ForwardLoss
    from tests.helpers import full_grads
    from tests.test_families import nonzero_lora_b

    cfg = vision_config(model_dir, data, out, lora, packing=info.world_size > 1)
    tokenizer = load_tokenizer(cfg)
    loaded = load_training_data(tokenizer, cfg, info, lambda: load_processor(cfg))
    model = build_sharded_model(cfg, info)
    load_vision_encoder(model, cfg, info.device)
    samples = loaded.train + loaded.eval
    if info.world_size == 1:
        mine = samples
    else:
        with_images = [s for s in samples if s.vision is not None]
        mine = [s for s in samples if s.vision is None] if info.rank == 0 else with_images
    n_targets = sum(sum(label != -100 for label in s.labels[1:]) for s in samples)
    pad = tokenizer.pad_token_id
    packed = collate_packed([mine[: len(mine) // 2], mine[len(mine) // 2 :]], pad)
    padded = collate(mine, pad)
    nonzero_lora_b(model)
    # the same records with black pictures: the images must move the loss (the image side really ran)
    black = collate_packed([[blacked(s) for s in row] for row in (mine[: len(mine) // 2], mine[len(mine) // 2 :])],
                           pad)
    with torch.no_grad():
        sums = [ForwardLoss()(model, batch, info.device).item() for batch in (padded, packed, black)]
    losses = all_reduce_sums(sums, info.device)
    for _ in range(2):  # two more steps' forwards and backwards: ranks whose images differ stay in step
        (ForwardLoss.for_config(cfg, info.device)(model, packed, info.device) / n_targets).backward()
    model.zero_grad(set_to_none=True)
    (ForwardLoss.for_config(cfg, info.device)(model, packed, info.device) / n_targets).backward()
    sum_replicated_gradients(model)  # a trained image side's, as the training step does
    layout = model_layout(model)
    grads = {adapter_file_key(name, layout): grad for name, grad in full_grads(model).items()}
    if adapter is not None:
        export_adapter(model, tokenizer, adapter, str(model_dir), info.is_main, to_yaml(cfg))
    return {"padded": losses[0] / n_targets, "packed": losses[1] / n_targets, "black": losses[2] / n_targets,
            "grads": grads,
            "images": sum(s.vision is not None for s in samples), "samples": samples}


def split_side(info, model_dir: Path, data: Path, out: Path, lora: dict | None = None) -> dict:
    """Every record in two packed rows, those rows split over the two ranks (context parallel: each rank holds
    half of them, images crossing the split): the loss and one step's gradients, image side included."""
    from qlora_fsdp.data.batching import collate_packed
    from qlora_fsdp.data.training_data import load_training_data
    from qlora_fsdp.distributed import all_reduce_sums
    from qlora_fsdp.distributed.grad_sync import sum_replicated_gradients
    from qlora_fsdp.loading.adapter import adapter_file_key
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.loading.fill import model_layout
    from qlora_fsdp.loading.vision_encoder import load_processor, load_vision_encoder
    from qlora_fsdp.losses.forward import ForwardLoss
    from qlora_fsdp.objectives.row_shards import shard_row
    from qlora_fsdp.vision.image_embeddings import image_token_of
    from tests.helpers import full_grads
    from tests.rank_pool import FRESH_PROCESS_SEED
    from tests.test_families import nonzero_lora_b

    torch.manual_seed(FRESH_PROCESS_SEED)  # the LoRA A matrices drawn as in a task of its own (the reference's)
    cfg = vision_config(model_dir, data, out, lora, packing=True)
    cfg.fsdp.context_parallel = 2
    tokenizer = load_tokenizer(cfg)
    loaded = load_training_data(tokenizer, cfg, info, lambda: load_processor(cfg))
    samples = loaded.train + loaded.eval
    model = build_sharded_model(cfg, info)
    load_vision_encoder(model, cfg, info.device)
    nonzero_lora_b(model)
    n_targets = sum(sum(label != -100 for label in s.labels[1:]) for s in samples)
    whole = collate_packed([samples[: len(samples) // 2], samples[len(samples) // 2 :]], tokenizer.pad_token_id)
    part = shard_row(whole, 2, info.rank, tokenizer.pad_token_id)
    loss = ForwardLoss.for_config(cfg, info.device)(model, part, info.device) / n_targets
    loss.backward()
    sum_replicated_gradients(model)
    layout = model_layout(model)
    here = int((part.input_ids == image_token_of(model)).sum())
    summed, *image_tokens = all_reduce_sums([loss.item(), here * (info.rank == 0), here * (info.rank == 1)],
                                            info.device)
    return {"loss": summed, "grads": {adapter_file_key(name, layout): g for name, g in full_grads(model).items()},
            "image_tokens": image_tokens}


def blacked(sample):
    """The sample with every picture black (its pixels at the processor's value for black)."""
    import dataclasses

    if sample.vision is None:
        return sample
    pixels = sample.vision["pixel_values"]
    return dataclasses.replace(sample, vision={**sample.vision, "pixel_values": torch.full_like(pixels, pixels.min())})


def reference_side(model_dir: Path, adapter: Path, samples: list, unquantized: list[str] | None = None) -> dict:
    """transformers' own NF4 load of the checkpoint's class (its vision tower and projector 4-bit where it makes
    them so), each record alone with its pixels (and, for Gemma 3, the token types that let an image's tokens see
    each other): the loss with PEFT loading our adapter, and its LoRA gradients."""
    import transformers
    from peft import PeftModel

    from qlora_fsdp.loading.adapter import peft_adapter_key
    from tests.helpers import decoder_lora_keys, transformers_nf4

    config = transformers.AutoConfig.from_pretrained(model_dir)
    base = transformers_nf4(model_dir, getattr(transformers, config.architectures[0]), unquantized)
    expected = decoder_lora_keys(base)
    model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    n_targets = sum(sum(label != -100 for label in s.labels[1:]) for s in samples)
    total = torch.zeros(())
    for sample in samples:
        ids = torch.tensor([sample.input_ids])
        extra = {**(dict(sample.vision) if sample.vision is not None else {}), **reference_extras(config, ids)}
        if config.model_type == "mllama" and sample.vision is not None:  # as its processor gives one sample
            extra = {**{key: value[None] for key, value in extra.items()},
                     "cross_attention_mask": mllama_cross_mask(sample.input_ids, extra, config)}
        logits = model(input_ids=ids, **extra).logits[0, :-1]
        total = total + torch.nn.functional.cross_entropy(logits.float(), torch.tensor(sample.labels[1:]),
                                                          ignore_index=-100, reduction="sum")
    loss = total / n_targets
    loss.backward()
    grads = {peft_adapter_key(name, "default"): p.grad for name, p in model.named_parameters() if p.requires_grad}
    return {"loss": loss.item(), "grads": grads, "expected": expected}


def reference_extras(config, ids: torch.Tensor) -> dict:
    """What transformers' VLM forward reads beside the pixels: where the image tokens are (Gemma 3's token types,
    which let an image's tokens see each other; Qwen-VL's, for its 3-axis positions)."""
    if config.model_type == "gemma3":
        return {"token_type_ids": (ids == config.image_token_id).long()}
    if config.model_type.startswith("qwen"):
        return {"mm_token_type_ids": (ids == config.image_token_id).int()}
    return {}


def mllama_cross_mask(ids: list[int], vision: dict, config) -> torch.Tensor:
    """The cross-attention mask Llama 3.2 Vision's processor makes for one sample (its own two functions)."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    sparse = get_cross_attention_token_mask(ids, config.image_token_id)
    tiles = vision["aspect_ratio_mask"].sum(-1).tolist()
    return torch.from_numpy(convert_sparse_cross_attention_mask_to_dense(
        [sparse], [tiles], config.vision_config.max_num_tiles, len(ids)))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_5_vl", "qwen3_vl", "mllama"])
def test_equals_transformers_nf4_with_images_at_world_sizes_1_and_2(family, llava, tmp_path):
    """Records with images (parts, two in one record, LLaMA-Factory markers) and text-only ones: the loss with the
    adapter, padded and packed, and one step's LoRA gradients equal transformers + bitsandbytes NF4 + PEFT, at world
    size 1 and at 2 with one rank text-only. LLaVA: image features into a Llama decoder, its image side trained
    (lora.train_projector, lora.target_vision_tower: the projector unquantized in transformers too, PEFT loading our
    adapter's modules_to_save and the tower's LoRA; the image side's gradients summed over the ranks by hand);
    Gemma 3: an image's tokens attend to each other both ways (and its sliding windows) in every kernel."""
    model_dir, data = llava if family == "llava" else tiny_vlm(tmp_path / "vlm", family)
    adapter = tmp_path / "adapter"
    trained = {"train_projector": True, "target_vision_tower": True} if family == "llava" else None
    one = run_ranks(our_side, 1, model_dir, data, tmp_path / "one", adapter, trained, tmp_dir=tmp_path)[0]
    if family in SPLITS:  # and the records' rows split over the two ranks (context parallel), images crossing it
        two, split = run_ranks_sequence([(our_side, (model_dir, data, tmp_path / "two", None, trained)),
                                         (split_side, (model_dir, data, tmp_path / "split", trained))], 2,
                                        tmp_path / "ranks")
    else:
        two = run_ranks(our_side, 2, model_dir, data, tmp_path / "two", None, trained, tmp_dir=tmp_path)[0]
    assert one["images"] == 6  # of 8 records
    unquantized = ["model.multi_modal_projector", "lm_head"] if trained else None
    reference = reference_side(model_dir, adapter, one["samples"], unquantized)
    print(f"{family}: transformers {reference['loss']:.6f}, ours ws1 {one['padded']:.6f} padded "
          f"{one['packed']:.6f} packed, ws2 {two['padded']:.6f} {two['packed']:.6f}")
    if trained:
        saved = json.loads((adapter / "adapter_config.json").read_text())
        image_side = [key for key in reference["grads"] if "vision_tower" in key or "projector" in key]
        assert saved["modules_to_save"] == ["model.multi_modal_projector"] and len(image_side) >= 16
        assert len([key for key in image_side if "lora_" in key]) >= 12  # the tower's LoRA, and the projector
    for run in (one, two):
        for key in ("padded", "packed"):
            assert run[key] == pytest.approx(reference["loss"], rel=1e-5), key
        assert abs(run["black"] - run["packed"]) > 1e-4, "black pictures left the loss as it was"
        assert reference["grads"].keys() >= reference["expected"] and len(reference["expected"]) >= 8
        assert run["grads"].keys() == reference["grads"].keys()
        for key, grad in reference["grads"].items():
            assert relative(run["grads"][key], grad) < 1e-5, key
    if family in SPLITS:
        assert min(split["image_tokens"]) > 0  # both parts of the split hold images
        assert split["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert split["grads"].keys() == reference["grads"].keys()
        for key, grad in reference["grads"].items():
            assert relative(split["grads"][key], grad) < 1e-5, key
    if family != "llava":  # LLaVA's are held after train.py's run
        merged_reply_and_generation(model_dir, adapter, data, tmp_path)


def test_records_become_replies_only_labels_with_each_images_tokens(llava, tmp_path):
    """The processor's encoding: targets are the replies (and their end-of-turn token) only, never an image token
    or a prompt; each image becomes its 16 tokens and its pixels; the errors name the file and record."""
    import json

    from transformers import AutoProcessor

    from qlora_fsdp.data.images import load_image_data
    from qlora_fsdp.errors import DataError

    model_dir, data = llava
    processor = AutoProcessor.from_pretrained(model_dir)
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    loaded = load_image_data(processor, vision_config(model_dir, data, tmp_path / "out",
                                                                   eval_samples=0))
    replies = [json.loads(line)["messages"][1]["content"] for line in data.read_text().splitlines()]
    replies = [r if isinstance(r, str) else r[0]["text"] for r in replies]
    eos = processor.tokenizer.eos_token
    got = []
    for sample in loaded.train:
        targets = [t for t, label in zip(sample.input_ids, sample.labels, strict=True) if label != -100]
        got.append(processor.tokenizer.decode(targets))
        images = sample.input_ids.count(image_token)
        assert all(label == -100 for t, label in zip(sample.input_ids, sample.labels, strict=True)
                   if t == image_token)
        shown = 0 if sample.vision is None else sample.vision["pixel_values"].shape[0]
        assert images == 16 * shown
    assert sorted(got) == sorted(reply + eos for reply in replies)
    # held out as text data is: at most a tenth of the records, or data.eval_path's
    capped = load_image_data(processor, vision_config(model_dir, data, tmp_path / "out", eval_samples=200))
    assert (len(capped.train), len(capped.eval)) == (len(replies) - 1, 1)
    held = tmp_path / "held" / "held.jsonl"
    held.parent.mkdir()
    for image in data.parent.glob("*.png"):
        (held.parent / image.name).write_bytes(image.read_bytes())
    held.write_text("\n".join(data.read_text().splitlines()[:3]) + "\n")
    separate = load_image_data(processor, vision_config(model_dir, data, tmp_path / "out", eval_samples=200,
                                                        eval_path=str(held)))
    assert (len(separate.train), len(separate.eval)) == (len(replies), 3)

    def refused(record: dict, name: str) -> str:
        path = tmp_path / name
        opening = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}
        path.write_text(json.dumps(opening) + "\n" + json.dumps(record) + "\n")
        (tmp_path / "red.png").write_bytes((data.parent / "red.png").read_bytes())
        with pytest.raises(DataError) as caught:
            load_image_data(processor, vision_config(model_dir, path, tmp_path / "out"))
        return str(caught.value)

    ask = {"role": "assistant", "content": "Red."}
    assert refused({"messages": [{"role": "user", "content": [{"type": "image", "image": "gone.png"}]}, ask]},
                   "missing.jsonl").startswith(f"{tmp_path / 'missing.jsonl'} record 2: image gone.png cannot be read")
    assert refused({"messages": [{"role": "user", "content": "<image><image>Two?"}, ask], "images": ["red.png"]},
                   "markers.jsonl") == (f"{tmp_path / 'markers.jsonl'} record 2: 2 <image> markers but 1 images left "
                                        "in `images`")
    assert refused({"messages": [{"role": "user", "content": "No marker."}, ask], "images": ["red.png"]},
                   "unshown.jsonl") == (f"{tmp_path / 'unshown.jsonl'} record 2: 1 of the record's `images` have no "
                                        "<image> marker in its messages")


@pytest.mark.slow
def test_train_py_learns_from_images_with_a_trained_image_side_and_merges_it(llava, tmp_path):
    """train.py on image records, 2 ranks, packed rows, the projector trained in full and LoRA on the vision tower
    (gradient clipping on, checkpoints saved): the held-out loss falls; a run stopped after a checkpoint and resumed
    ends with the uninterrupted run's adapter, bit for bit; the adapter loads with PEFT onto the checkpoint's own
    class; the merged checkpoint computes what PEFT's 4-bit model with the adapter computes."""
    from safetensors.torch import load_file

    from tests.helpers import run_cli

    model_dir, data = llava
    out, stopped = tmp_path / "run", tmp_path / "stopped"
    args = ["--recipe", "tiny_cpu", f"model.path={model_dir}", f"data.path={data}", "data.format=chat",
            "data.eval_samples=2", "data.micro_batch_size=2", "data.grad_accum_steps=1", "train.max_steps=30",
            "train.eval_every=0", "train.save_every=15", "optim.warmup_steps=0", "optim.max_grad_norm=1.0",
            "lora.train_projector=true", "lora.target_vision_tower=true",
            "model.dtype=float32", "quant.compute_dtype=float32",  # the merge is then held to fp32 PEFT
            "logging.plot=false"]
    results = run_cli([*args, f"train.output_dir={out}"], 2, tmp_path)
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:]
    summary = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    print(f"LLaVA on images: held-out loss {summary['eval_loss_start']:.3f} -> {summary['eval_loss_end']:.3f}")
    assert summary["eval_loss_end"] < 0.8 * summary["eval_loss_start"]
    # stopped at step 20 (after the checkpoint of step 15) and resumed: the adapter of the uninterrupted run, exactly
    halted = run_cli([*args, f"train.output_dir={stopped}"], 2, tmp_path, faults=(("user_error_at_step", (20, None)),))
    assert [r.returncode for r in halted] == [2, 2]
    resumed = run_cli([*args, f"train.output_dir={stopped}", "--resume"], 2, tmp_path)
    assert [r.returncode for r in resumed] == [0, 0] and "resumed from" in resumed[0].stdout, resumed[0].stderr[-2000:]
    uninterrupted = load_file(out / "adapter" / "adapter_model.safetensors")
    again = load_file(stopped / "adapter" / "adapter_model.safetensors")
    assert uninterrupted.keys() == again.keys() and any("vision_tower" in key for key in again)
    assert all(torch.equal(again[key], value) for key, value in uninterrupted.items())
    merged_reply_and_generation(model_dir, out / "adapter", data, tmp_path, ["model.multi_modal_projector", "lm_head"])


def merged_reply_and_generation(model_dir: Path, adapter: Path, data: Path, tmp_path: Path,
                                trained_image_side: list[str] | None = None) -> None:
    """The adapter loads with PEFT onto the checkpoint's own class; the merged checkpoint holds the image side as
    stored (or, where it trained, gives PEFT's logits: `trained_image_side` is what transformers keeps unquantized
    for it) and runs on an image; `generate --image` (our 4-bit model with the adapter) replies as PEFT on
    transformers' NF4 model does (greedy)."""
    import transformers
    from peft import PeftModel
    from PIL import Image
    from safetensors.torch import load_file

    from qlora_fsdp.commands.generate import main as generate_main
    from qlora_fsdp.loading.adapter import config_for_adapter
    from qlora_fsdp.loading.vision_encoder import load_processor
    from qlora_fsdp.tools.adapter_merge import merge_adapter
    from tests.helpers import command_here, transformers_nf4

    model_class = getattr(transformers, transformers.AutoConfig.from_pretrained(model_dir).architectures[0])
    peft_model = PeftModel.from_pretrained(transformers_nf4(model_dir, model_class, trained_image_side), adapter)
    assert any("lora_A" in name for name, _ in peft_model.named_parameters())
    merged_dir = tmp_path / "merged"
    merge_adapter(config_for_adapter(adapter, None, []), adapter, merged_dir, "float32")
    stored, merged = load_file(model_dir / "model.safetensors"), load_file(merged_dir / "model.safetensors")
    # the vision tower and projector, by the names each family stores them under (Qwen: its hub's `visual.`)
    image_side = [key for key in stored
                  if any(part in key for part in ("vision_tower", "vision_model", "projector", "visual."))]
    unchanged = [key for key in image_side if torch.equal(merged[key].float(), stored[key].float())]
    assert len(image_side) >= 8 and (unchanged == image_side) == (trained_image_side is None)
    model = model_class.from_pretrained(merged_dir, dtype=torch.float32)
    processor = load_processor(tiny_config(model_dir))  # Qwen's without torchvision
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": "Colour?"}]}],
                                         tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.open(data.parent / "red.png")], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
        assert torch.isfinite(logits).all()
        if trained_image_side is not None:  # the merge into the weights as trained (4-bit, dequantized)
            assert relative(logits, peft_model(**inputs).logits) < 1e-5
        prompt_len = inputs["input_ids"].shape[1]
        theirs = peft_model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, prompt_len:]
    expected = processor.tokenizer.decode(theirs, skip_special_tokens=True)
    replied = command_here(generate_main, ["--adapter", str(adapter), "--prompt", "Colour?", "--image",
                                           str(data.parent / "red.png"), "--max-new-tokens", "6"])
    assert replied.returncode == 0, replied.stderr[-2000:]
    assert replied.stdout.splitlines() == [expected]


def test_images_by_url_and_from_a_saved_hub_dataset_encode_as_files_do(llava, tmp_path):
    """The same record with its image as a file, as a URL (a local server) and in a datasets Image column saved
    with save_to_disk (as a hub dataset arrives): the same ids, labels and pixels; a dead URL is one line."""
    import http.server
    import threading
    from functools import partial

    import datasets
    from transformers import AutoProcessor

    from qlora_fsdp.data.images import load_image_data
    from qlora_fsdp.errors import DataError

    model_dir, data = llava
    processor = AutoProcessor.from_pretrained(model_dir)
    folder = data.parent

    def record(image: object) -> dict:
        return {"messages": [{"role": "user", "content": "<image>Name the colour."},
                             {"role": "assistant", "content": "Blue."}], "images": [image]}

    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    (tmp_path / "blue.png").write_bytes((folder / "blue.png").read_bytes())
    try:
        files = {"file.jsonl": "blue.png", "url.jsonl": f"{url}/blue.png"}
        encoded = []
        for name, image in files.items():
            (tmp_path / name).write_text((json.dumps(record(image)) + "\n") * 2)
            encoded.append(load_image_data(processor, vision_config(
                model_dir, tmp_path / name, tmp_path / "out", eval_samples=0)).train[0])
        hub = datasets.Dataset.from_dict({"messages": [record(None)["messages"]] * 2,
                                          "images": [[str(tmp_path / "blue.png")]] * 2},
                                         features=datasets.Features({
                                             "messages": [{"role": datasets.Value("string"),
                                                           "content": datasets.Value("string")}],
                                             "images": datasets.Sequence(datasets.Image())}))
        hub.save_to_disk(tmp_path / "hub")
        encoded.append(load_image_data(processor, vision_config(
            model_dir, tmp_path / "hub", tmp_path / "out", eval_samples=0)).train[0])
        for sample in encoded[1:]:
            assert sample.input_ids == encoded[0].input_ids and sample.labels == encoded[0].labels
            assert torch.equal(sample.vision["pixel_values"], encoded[0].vision["pixel_values"])
        (tmp_path / "dead.jsonl").write_text(json.dumps(record(f"{url}/gone.png")) + "\n")
        with pytest.raises(DataError, match=r"dead.jsonl record 1: image http://127.0.0.1:\d+/gone.png cannot be "
                                            r"fetched or read \(HTTP Error 404"):
            load_image_data(processor, vision_config(model_dir, tmp_path / "dead.jsonl",
                                                                  tmp_path / "out"))
    finally:
        server.shutdown()


def test_images_for_a_family_not_checked_yet_are_refused_in_one_line(tmp_path):
    """Qwen2-VL (Qwen2.5-VL's predecessor, its vision tower not checked here): refused, with the reason, before the
    processor is read (never a loss that differs from transformers')."""
    from transformers import Qwen2VLConfig

    from qlora_fsdp.errors import ModelLoadError
    from qlora_fsdp.loading.vision_encoder import load_processor

    Qwen2VLConfig().save_pretrained(tmp_path / "qwen2_vl")
    with pytest.raises(ModelLoadError, match=r"^records with images are not supported for qwen2_vl yet: its vision "
                                             r"tower is not checked yet \(Qwen2.5-VL's is\); train it on text records, "
                                             r"or use a checkpoint of LLaVA, Gemma 3, Qwen2.5-VL, Qwen3-VL, Llama 3.2 "
                                             r"Vision$"):
        load_processor(tiny_config(tmp_path / "qwen2_vl"))


def test_images_in_split_rows_are_refused_in_one_line_where_the_family_needs_the_whole_row(tmp_path):
    """Context parallel with images trains LLaVA's and Qwen-VL's (each rank its image tokens' features, positions
    and deepstack rows: checked above); a family whose image tokens need the whole row (Gemma 3's both-ways masks,
    Llama 3.2 Vision's cross-attention) is refused before any weight is read, naming why."""
    from transformers import Gemma3Config, LlavaConfig, MllamaConfig, Qwen2_5_VLConfig, Qwen3VLConfig

    from qlora_fsdp.api import check_image_levers
    from qlora_fsdp.errors import ConfigError

    needs = {"gemma3": (Gemma3Config, "Gemma 3: its image tokens attend to each other both ways"),
             "mllama": (MllamaConfig, "Llama 3.2 Vision: its text reads the images in cross-attention layers"),
             "llava": (LlavaConfig, None), "qwen2_5_vl": (Qwen2_5_VLConfig, None), "qwen3_vl": (Qwen3VLConfig, None)}
    for family, (config_class, why) in needs.items():
        config_class().save_pretrained(tmp_path / family)
        cfg = tiny_config(tmp_path / family, fsdp={"context_parallel": 2})
        check_image_levers(tiny_config(tmp_path / family), True)  # whole rows: every family
        if why is None:
            check_image_levers(cfg, True)
            continue
        with pytest.raises(ConfigError, match=rf"^'fsdp\.context_parallel: 2' with images of {why}.*, which a split "
                                              r"row is not built for yet; use fsdp\.context_parallel: 1$"):
            check_image_levers(cfg, True)


@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_5_vl", "qwen3_vl", "mllama"])
def test_the_plans_image_side_is_the_built_encoders_bytes(family, llava, tmp_path):
    """--plan counts the image side from the meta model (NF4 where transformers quantizes, its statistics, the rest
    in the compute dtype): the very bytes the built encoder holds."""
    from qlora_fsdp.loading.vision_encoder import build_vision_encoder
    from qlora_fsdp.measure.image_side import full_config, image_side, weight_bytes
    from qlora_fsdp.measure.planning import Planning

    model_dir, data = llava if family == "llava" else tiny_vlm(tmp_path / "vlm", family)
    budget = {"image_max_pixels": 56 * 56} if family.startswith("qwen") else {}
    cfg = vision_config(model_dir, data, tmp_path / "out", images_per_row=2, **budget)
    base = build_vision_encoder(cfg, torch.device("cpu")).base
    assert weight_bytes(full_config(Planning.of(cfg)), cfg) == held_bytes(base)
    side = image_side(Planning.of(cfg), cfg)
    assert side is not None and side.images == 2 * cfg.data.micro_batch and (side.masks > 0) == (family == "gemma3")
    assert_pixel_budget(family, cfg, side.tokens_per_image)
    assert_unquantized_tower(cfg, data)
    assert_trained_side_bytes(cfg)


def held_bytes(base: torch.nn.Module) -> int:
    """What a built image side holds: its parameters, and each 4-bit layer's quantization statistics."""
    import bitsandbytes as bnb

    held = sum(p.numel() * p.element_size() for p in base.parameters())
    for module in base.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.quant_state
            parts = [state.absmax, state.code, state.state2.absmax, state.state2.code, state.offset]
            held += sum(t.numel() * t.element_size() for t in parts)
    return held


def assert_trained_side_bytes(cfg) -> None:
    """lora.train_projector and lora.target_vision_tower: the encoder holds the plan's bytes (the projector whole in
    lora.dtype, LoRA on the tower's linears), and the plan's gradients and optimizer state are those of exactly the
    tensors that train."""
    import dataclasses

    from qlora_fsdp.loading.vision_encoder import build_vision_encoder
    from qlora_fsdp.measure.image_side import full_config, side_of, weight_bytes
    from qlora_fsdp.measure.planning import Planning
    from qlora_fsdp.optimizer_registry import OPTIMIZERS

    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, train_projector=True, target_vision_tower=True))
    base = build_vision_encoder(cfg, torch.device("cpu")).base
    assert weight_bytes(full_config(Planning.of(cfg)), cfg) == held_bytes(base)
    trained = [p for p in base.parameters() if p.requires_grad]
    lora = [p for name, p in base.named_parameters() if ".lora_" in name]
    assert len(lora) >= 8 and len(trained) > len(lora)  # the tower's LoRA and the projector
    n = sum(p.numel() for p in trained)
    assert side_of(Planning.of(cfg), cfg).trained == n * 4 + OPTIMIZERS[cfg.optim.name].state_bytes(n, 4)


def assert_unquantized_tower(cfg, data: Path) -> None:
    """quant.vision_tower: unquantized keeps the image side in the compute dtype: no 4-bit layer, the plan's bytes
    the built ones, and the features of transformers' own unquantized model on a record's image."""
    import dataclasses

    import bitsandbytes as bnb
    import transformers

    from qlora_fsdp.data.images import encode_record
    from qlora_fsdp.loading.vision_encoder import build_vision_encoder, load_processor
    from qlora_fsdp.measure.image_side import full_config, weight_bytes
    from qlora_fsdp.measure.planning import Planning

    cfg = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, vision_tower="unquantized"))
    encoder = build_vision_encoder(cfg, torch.device("cpu"))
    assert not any(isinstance(module, bnb.nn.Linear4bit) for module in encoder.base.modules())
    built = sum(p.numel() * p.element_size() for p in encoder.base.parameters())
    assert weight_bytes(full_config(Planning.of(cfg)), cfg) == built
    record = json.loads(data.read_text().splitlines()[0])
    vision = encode_record(record, load_processor(cfg), data.parent, "record 1").vision
    config = transformers.AutoConfig.from_pretrained(cfg.model.path)
    theirs = getattr(transformers, config.architectures[0]).from_pretrained(cfg.model.path, dtype=torch.float32)
    reference = dataclasses.replace(encoder, base=theirs.model)
    ours, expected = (e.features(vision, torch.device("cpu")).features for e in (encoder, reference))
    assert ours.numel() >= 4 * ours.shape[-1] and torch.equal(ours, expected)  # 4 image tokens (or states) at least


def assert_pixel_budget(family: str, cfg, planned_tokens: int) -> None:
    """Qwen-VL: the recipe's data.image_max_pixels is the processor's (a 300x200 image is resized into it) and the
    plan's tokens an image; a fixed-size family refuses the key in one line, and Qwen's plan asks for it."""
    import dataclasses

    from PIL import Image

    from qlora_fsdp.errors import ConfigError
    from qlora_fsdp.loading.vision_encoder import load_processor
    from qlora_fsdp.measure.image_side import side_of
    from qlora_fsdp.measure.planning import Planning

    if not family.startswith("qwen"):
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, image_max_pixels=56 * 56))
        with pytest.raises(ConfigError, match=r"^data.image_min_pixels / image_max_pixels: .* resizes every image to "
                                              r"one size; .*: remove the keys$"):
            load_processor(cfg)
        return
    grid = load_processor(cfg).image_processor(images=[Image.new("RGB", (300, 200))])["image_grid_thw"]
    assert grid.tolist() == [[1, 2, 4]]  # 8 patches (of 14 or 16 pixels): 2 tokens, within 56x56 pixels
    patch = 14 if family == "qwen2_5_vl" else 16
    assert planned_tokens == 56 * 56 // patch**2 // 4 == (4 if patch == 14 else 3)
    unbudgeted = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, image_max_pixels=None))
    with pytest.raises(ConfigError, match=r"set data.image_max_pixels"):
        side_of(Planning.of(unbudgeted), unbudgeted)


# the image side reads these, and a tiny LLaVA cannot show it (the key keeps them for the families that do)
IMAGE_KEYS_NOT_SHOWN = {"data.image_max_pixels": "a dynamic-resolution family's pixel budget (Qwen-VL)",
                        "data.context_length": "Gemma 3's both-ways masks"}


def test_the_image_side_key_changes_exactly_where_the_image_side_does(llava, tmp_path):
    """measure/image_side.py's key, held as the step's is (tests/test_step_setting.py): every recipe key turned alone;
    those that leave the key as it was, turned all together, leave the image side too; each other changes it."""
    from qlora_fsdp.measure.image_side import image_setting, side_of
    from qlora_fsdp.measure.planning import Planning
    from tests.config_changes import changes
    from tests.test_step_setting import taken

    model_dir, data = llava
    base = vision_config(model_dir, data, tmp_path / "out", images_per_row=2)
    planning = Planning.of(base)  # one model: what the planning holds, not the key
    turned = dict(changes(base))
    unchanged = [name for name, cfg in turned.items() if image_setting(cfg) == image_setting(base)]
    together = base
    for name in unchanged:
        together = taken(together, turned[name], name)
    assert side_of(planning, together) == side_of(planning, base), unchanged
    needless = sorted(name for name, cfg in turned.items()
                      if name not in unchanged and side_of(planning, cfg) == side_of(planning, base))
    assert needless == sorted(IMAGE_KEYS_NOT_SHOWN), needless
