"""GRPO's fused decoding kernels (qlora_fsdp/kernels/), run by Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1): the NF4 matmul against bitsandbytes' dequantization and PEFT's LoRA on a real Linear4bit, the
decode attention against sdpa over the cache's filled part, and where the kernels run.

Shapes are tiny (the interpreter runs every program in Python) but cover what matters: more than 256 absmax
blocks (the nested absmax's second level), row counts that are not a tile's, K split in several parts, grouped
heads, left padding, a cache whose unfilled slots hold NaN (a read past the filled length shows).
"""

from __future__ import annotations

import functools

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import peft
import pytest
import torch
from torch import nn

from qlora_fsdp.errors import ConfigError
from qlora_fsdp.kernels import fused_decoding
from qlora_fsdp.kernels.decode_attention import decode_attention
from qlora_fsdp.kernels.nf4_matmul import Tiles, dequantize, nf4_lora_matmul, packed_nf4, tiles_for
from tests.helpers import fp32_reordering_bound


def quantized(out_features: int, in_features: int, nested: bool, seed: int = 0) -> tuple[torch.Tensor, object]:
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features) * torch.linspace(0.1, 3.0, in_features)  # blocks differ
    return bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=nested, quant_type="nf4",
                              quant_storage=torch.uint8)


@pytest.mark.parametrize("nested", [True, False])
def test_the_kernels_dequantized_weight_is_bitsandbytes_bit_for_bit(nested):
    packed, state = quantized(136, 128, nested)  # 272 absmax blocks: two blocks of the nested second level
    ours = dequantize(packed_nf4(packed, state))
    assert torch.equal(ours, bnbf.dequantize_4bit(packed, state))


def lora_linear(in_features: int, out_features: int, bias: bool, rank: int = 6) -> nn.Module:
    """PEFT's LoRA over bitsandbytes' Linear4bit (fp32 compute), its B not zero, alpha != r."""
    torch.manual_seed(1)
    dense = nn.Linear(in_features, out_features, bias=bias)
    base = bnb.nn.Linear4bit(in_features, out_features, bias=bias, compute_dtype=torch.float32, quant_type="nf4")
    base.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, quant_type="nf4", blocksize=64,
                                    compress_statistics=True)._quantize("cpu")
    base.support_avx512bf16_for_cpu = False  # the portable kernel, as training's (DESIGN.md, CPU eval trap)
    if bias:
        base.bias = nn.Parameter(dense.bias.data * 10)
    holder = nn.Sequential()
    holder.add_module("q_proj", base)
    model = peft.get_peft_model(holder, peft.LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj"]))
    layer = model.base_model.model.q_proj
    nn.init.normal_(layer.lora_B["default"].weight, std=0.2)
    return layer.eval()


@pytest.mark.parametrize("bias", [True, False])
def test_the_fused_matmul_is_bitsandbytes_and_peft_within_summation_order(bias):
    layer = lora_linear(128, 72, bias)
    base = layer.get_base_layer()
    weight = packed_nf4(base.weight, base.weight.quant_state)
    lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    for rows, tiles in ((1, None), (5, Tiles(16, 32, 32, 2)), (19, Tiles(16, 64, 32, 4))):
        x = torch.randn(rows, 128)
        with torch.no_grad():
            expected = layer(x)
            ours = nf4_lora_matmul(x, weight, lora_a, lora_b, layer.scaling["default"], base.bias, tiles)
        assert ours.shape == expected.shape
        assert torch.allclose(ours, expected, rtol=1e-5, atol=1e-5), (rows, (ours - expected).abs().max())
        without_lora = nf4_lora_matmul(x, weight, bias=base.bias, tiles=tiles)
        assert torch.allclose(without_lora, base(x), rtol=1e-5, atol=1e-5)


def test_split_k_is_deterministic_and_sized_to_fill_a_gpu():
    packed, state = quantized(64, 256, True)
    x = torch.randn(3, 256)
    weight = packed_nf4(packed, state)
    runs = [nf4_lora_matmul(x, weight, tiles=Tiles(16, 64, 64, 4)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    # on a GPU: a 1B model's projection at 32 rows (32 programs unsplit) splits; 256 rows of 8,192 outputs do not
    assert tiles_for(32, 2048, 2048, interpreted=False).splits > 1
    assert tiles_for(256, 8192, 2048, interpreted=False).splits == 1


def test_decode_attention_reads_only_the_filled_cache_with_grouped_heads_and_padding():
    torch.manual_seed(0)
    rows, q_heads, kv_heads, slots, dim, filled = 3, 4, 2, 40, 16, 29
    query = torch.randn(rows, q_heads, 1, dim)
    keys, values = torch.randn(rows, kv_heads, slots, dim), torch.randn(rows, kv_heads, slots, dim)
    keys[:, :, filled:] = values[:, :, filled:] = float("nan")  # never written: reading them poisons the output
    valid = torch.ones(rows, slots, dtype=torch.bool)
    valid[0, :5] = valid[1, :1] = False  # left padding
    ours = decode_attention(query, keys, values, torch.tensor(filled), valid, dim**-0.5, block=8)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys[:, :, :filled], values[:, :, :filled], attn_mask=valid[:, None, None, :filled],
        enable_gqa=True, scale=dim**-0.5).transpose(1, 2)
    # 8-slot blocks against sdpa's own: the same sums over the filled slots in another order (1.8e-7 seen)
    bound = fp32_reordering_bound(filled) * float(expected.abs().max())
    assert torch.allclose(ours, expected, atol=bound), (ours - expected).abs().max()


def test_where_the_kernels_run_and_the_one_line_otherwise(monkeypatch, capsys):
    cpu = torch.device("cpu")
    assert not fused_decoding.kernels_wanted("off", cpu)
    assert fused_decoding.kernels_wanted("fused", cpu)  # the interpreter: the tests' way
    monkeypatch.setattr(fused_decoding, "SAID", [])
    assert not fused_decoding.kernels_wanted("auto", cpu) and not fused_decoding.kernels_wanted("auto", cpu)
    said = capsys.readouterr().out.splitlines()
    assert said == ["GRPO generation: decoding through bitsandbytes and sdpa on a CPU (the kernels run on sm86, "
                    "sm89 and sm90 GPUs)"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="^generation.kernels: fused cannot run on a CPU") as raised:
        fused_decoding.kernels_wanted("fused", cpu)
    assert "\n" not in str(raised.value)


def test_the_decoding_loop_equals_generate_tokens_log_probabilities_and_padding(tmp_path):
    """The fused kernels' decoding loop against transformers' generate on the same 4-bit policy with its adapter
    (the kernels on for both): the same rows, a row that hits an end id padded from the next token on, the same
    log-probabilities; greedy, and sampled from one seed."""
    from transformers import StaticCache

    from qlora_fsdp.distributed import DistInfo
    from qlora_fsdp.kernels.decoding_loop import loop_generate
    from qlora_fsdp.loading.factory import build_sharded_model
    from qlora_fsdp.objectives.rollouts import SampledLogps, generating
    from tests.helpers import build_tiny_checkpoint, tiny_config

    cfg = tiny_config(build_tiny_checkpoint(tmp_path / "model", layers=1), lora={"r": 4, "dropout": 0.0})
    model = build_sharded_model(cfg, DistInfo(0, 0, 1, torch.device("cpu"), None), shard=False)
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.1)
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10], [2, 2, 11, 12, 13, 14]])
    mask = (input_ids != 2).long()

    def call(sample, ends: list[int], do_sample: bool) -> tuple[torch.Tensor, list[list[float]]]:
        cache = StaticCache(config=model.config, max_cache_len=64)
        fused_decoding.watch(cache)
        recorder = SampledLogps(0.8 if do_sample else 1.0)
        torch.manual_seed(5)
        out = sample(input_ids=input_ids, attention_mask=mask, max_new_tokens=6, eos_token_id=ends, pad_token_id=2,
                     do_sample=do_sample, temperature=0.8 if do_sample else None, top_k=20 if do_sample else None,
                     top_p=0.9 if do_sample else None, past_key_values=cache, logits_processor=[recorder],
                     use_cache=True, disable_compile=True, repetition_penalty=1.0)
        return out, recorder.finish(out)

    with generating(model), fused_decoding.fused_decoding(model, "fused", torch.device("cpu")):
        free, _ = call(model.generate, [1], False)  # no row ends (id 1 is never the likeliest here)
        ends = [int(free[0, 8])]  # the first row's third new token ends it
        for do_sample in (False, True):
            theirs, their_logps = call(model.generate, ends, do_sample)
            ours, our_logps = call(functools.partial(loop_generate, model), ends, do_sample)
            width = theirs.shape[1]
            assert torch.equal(ours[:, :width], theirs) and bool((ours[:, width:] == 2).all()), do_sample
            assert torch.allclose(torch.tensor(our_logps)[:, : width - 6], torch.tensor(their_logps), atol=1e-5)
            if not do_sample:  # the first row ended at its third token and was padded after it
                assert theirs[0, 8] == ends[0] and bool((theirs[0, 9:] == 2).all()) and theirs.shape[1] > 9
