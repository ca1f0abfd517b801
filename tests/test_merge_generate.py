"""After training: the merged checkpoint computes base + adapter; generation applies the adapter."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, AutoTokenizer

from qlora_fsdp.commands.generate import main as generate_main
from qlora_fsdp.commands.merge import main as merge_main
from qlora_fsdp.config import to_yaml
from qlora_fsdp.data.templates import prompt_ids
from qlora_fsdp.loading.adapter import config_for_adapter, export_adapter
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.tools.adapter_merge import LoraDelta, merge_adapter
from qlora_fsdp.tools.adapter_sampling import Sampling, load_generator
from tests.helpers import CliResult, command_here, fsdp_params, run_ranks, run_ranks_sequence, tiny_config

PROMPT = "Reverse the word: planet"


def adapter_and_logits(info, cfg, adapter_dir, input_ids):
    """A LoRA (or DoRA) adapter far from its init, exported as training does, and the 4-bit model's logits."""
    model = build_sharded_model(cfg, info, shard=False)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_magnitude_vector" in name:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    export_adapter(model, load_tokenizer(cfg), adapter_dir, cfg.model.path, True, to_yaml(cfg))
    with torch.no_grad():
        with_adapter = model(input_ids=input_ids).logits
        with model.disable_adapter():
            base = model(input_ids=input_ids).logits
    return with_adapter, base


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """{'lora'|'dora': (adapter folder, the 4-bit model's logits with it, without it)}, made in one start-up."""
    root = tmp_path_factory.mktemp("adapters")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    input_ids = torch.tensor([prompt_ids([{"role": "user", "content": PROMPT}], tokenizer, "alpaca")])
    kinds = {"lora": False, "dora": True}
    calls = [(adapter_and_logits, (tiny_config(tiny_model_dir, lora={"use_dora": dora}), root / kind, input_ids))
             for kind, dora in kinds.items()]
    results = run_ranks_sequence(calls, 1, root)
    return {kind: (root / kind, *result) for kind, result in zip(kinds, results, strict=True)}, input_ids


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_merged_checkpoint_reproduces_base_plus_adapter(adapters, tmp_path, kind):
    (adapter, ours, base), input_ids = adapters[0][kind], adapters[1]
    assert (ours - base).abs().max() > 0.1  # the adapter matters, so matching it means something
    merged_dir = tmp_path / "merged"
    shards = merge_adapter(config_for_adapter(adapter, None, []), adapter, merged_dir, "float32", 200_000)
    index = json.loads((merged_dir / "model.safetensors.index.json").read_text())
    assert shards > 1 and len(set(index["weight_map"].values())) == shards  # shards of at most 200 KB
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        logits = merged(input_ids=input_ids).logits
    assert (logits - ours).abs().max() < 1e-4 * ours.abs().max()
    original = merge_adapter(config_for_adapter(adapter, None, []), adapter, tmp_path / "original", "float32",
                             2**30, base_weights="original")
    with torch.no_grad():  # adding to the unquantized weights is a different model (the quantization error)
        other = AutoModelForCausalLM.from_pretrained(tmp_path / "original", dtype=torch.float32)(input_ids).logits
    assert original == 1 and (other - ours).abs().max() > 100 * (logits - ours).abs().max()


@pytest.mark.parametrize("dora", [False, True])
def test_merge_moves_the_adapter_to_the_device_of_the_weight(dora):
    """`merge_adapter.py --device cuda`: the base weight is on the GPU, the adapter as read, on the CPU. The meta
    device stands in for the GPU: torch refuses to mix it with CPU tensors in one op, as it does cuda and cpu."""
    generator = torch.Generator().manual_seed(0)
    a, b, weight = (torch.randn(shape, generator=generator) for shape in [(2, 4), (6, 2), (6, 4)])
    delta = LoraDelta(a, b, 0.5, torch.rand(6, generator=generator) + 0.5 if dora else None)
    on_cpu = delta.merged(weight.bfloat16())
    on_meta = delta.merged(weight.bfloat16().to("meta"))
    assert on_meta.device.type == "meta" and on_meta.shape == on_cpu.shape and on_meta.dtype == on_cpu.dtype


@pytest.mark.slow
def test_merge_command_writes_a_bf16_checkpoint_and_never_clobbers(adapters, tmp_path):
    (adapter, ours, _), input_ids = adapters[0]["lora"], adapters[1]
    out = tmp_path / "merged"
    result = command_here(merge_main, ["--adapter", adapter, "--out", out])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(1 shard, bfloat16" in result.stdout
    assert result.stdout.startswith("writing about ") and " MB (bfloat16)\n" in result.stdout  # before the merge
    half = AutoModelForCausalLM.from_pretrained(out)
    assert half.dtype == torch.bfloat16 and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file()  # the folder is complete for from_pretrained and pipelines
    with torch.no_grad():
        assert (half(input_ids=input_ids).logits.float() - ours).abs().max() < 0.05 * ours.abs().max()
    again = command_here(merge_main, ["--adapter", adapter, "--out", out])
    assert again.returncode == 2 and "exists and is not empty" in again.stderr


@pytest.mark.slow
def test_generate_applies_the_adapter_and_matches_the_merged_model(adapters, tmp_path):
    (adapter, _, _), input_ids = adapters[0]["lora"], adapters[1]
    cfg = config_for_adapter(adapter, None, [])
    merge_adapter(cfg, adapter, tmp_path / "merged", "float32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    greedy = merged.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=12,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    expected = tokenizer.decode(greedy[0, input_ids.shape[1]:], skip_special_tokens=True)
    assert expected.strip()

    piped = command_here(generate_main, ["--adapter", adapter, "--max-new-tokens", "12"],
                         stdin=f"{PROMPT}\n\n{PROMPT}\n")
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert piped.stdout.split("\n")[:-1] == [expected, expected]  # one reply per prompt line, blank lines skipped

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(to_yaml(cfg))
    base_only = command_here(generate_main, ["--no-adapter", "--recipe", recipe, "--prompt", PROMPT,
                                             "--max-new-tokens", "12"])
    assert base_only.returncode == 0, base_only.stderr[-3000:]
    assert base_only.stdout.rstrip("\n") != expected  # the adapter changed the reply


GREEDY, SAMPLED = Sampling(max_new_tokens=12), Sampling(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3)


def sample_as_loaded(info, adapter, offload, apply_adapter=True):
    """Greedy and seeded-sampled token ids of the reply to PROMPT, how the model was held (FSDP2 or not, and
    each parameter's offload), and the world size; the adapter's settings either way, its weights if applied."""
    generator = load_generator(config_for_adapter(adapter, None, []), adapter if apply_adapter else None, offload)
    held = (isinstance(generator.model, FSDPModule), sorted({p.offload_to_cpu for p in fsdp_params(generator.model)}))
    return generator.token_ids(PROMPT, GREEDY), generator.token_ids(PROMPT, SAMPLED), held, info.world_size


@pytest.fixture(scope="module")
def one_process_replies(adapters, tmp_path_factory):
    """One process: the 4-bit model unsharded (as generate.py always ran), without the adapter, and offloaded
    (FSDP2 at world size 1 with CPUOffloadPolicy: the one-GPU 70B path)."""
    adapter = adapters[0]["lora"][0]
    calls = [(sample_as_loaded, (adapter, False)), (sample_as_loaded, (adapter, False, False)),
             (sample_as_loaded, (adapter, True))]
    unsharded, base, offloaded = run_ranks_sequence(calls, 1, tmp_path_factory.mktemp("one_process"))
    assert unsharded[2:] == ((False, []), 1) and offloaded[2:] == ((True, [True]), 1)  # no FSDP2; FSDP2 offloaded
    assert unsharded[0] != base[0]  # the adapter changes the greedy reply, so matching it means something
    return adapter, unsharded[:2], offloaded[:2]


@pytest.mark.slow
def test_sharded_and_offloaded_sampling_give_the_unsharded_tokens(one_process_replies, tmp_path):
    """FSDP2 over 2 gloo ranks and offloaded at world size 1 draw exactly the unsharded model's greedy and
    seeded-sampled tokens, on every rank (2 ranks with offload: the generate command test below)."""
    adapter, expected, offloaded = one_process_replies
    assert offloaded == expected
    for sharded in run_ranks(sample_as_loaded, 2, adapter, False, tmp_dir=tmp_path):
        assert sharded[2:] == ((True, [False]), 2) and sharded[:2] == expected


def generate_on_rank(info, argv: list[str], stdin: str) -> CliResult:
    return command_here(generate_main, argv, stdin if info.rank == 0 else "")  # a rank other than 0 reads nothing


@pytest.mark.slow
def test_generate_on_two_ranks_prints_rank_0s_replies_once(one_process_replies, tmp_path):
    """`torchrun --nproc_per_node 2 scripts/generate.py --offload`: rank 0 reads stdin and hands each prompt to
    both ranks; one reply a prompt, printed by rank 0 alone, the unsharded model's."""
    adapter, (greedy, _), _ = one_process_replies
    expected = AutoTokenizer.from_pretrained(adapter).decode(greedy, skip_special_tokens=True)
    first, second = run_ranks(generate_on_rank, 2, ["--adapter", str(adapter), "--max-new-tokens", "12", "--offload"],
                              f"{PROMPT}\n{PROMPT}\n", tmp_dir=tmp_path)
    assert first.returncode == second.returncode == 0, first.stderr[-3000:]
    assert first.stdout.split("\n")[:-1] == [expected, expected] and second.stdout == ""
