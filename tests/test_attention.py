"""Attention kernels: per-sample attention of packed rows equals the dense block-diagonal mask, values and
gradients, and the training loss of a packed batch is the same under every kernel (and the same as each sample
alone). The packed-equals-alone check per kernel at model level is in test_data.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from qlora_fsdp.data.batching import Sample, collate, collate_packed
from qlora_fsdp.errors import ConfigError
from qlora_fsdp.families import AttentionNeeds
from qlora_fsdp.layers import attention as attention_module
from qlora_fsdp.layers import blockwise_attention as blockwise
from qlora_fsdp.layers.attention import (
    VARLEN_SDPA,
    refuse_row_position_scaling,
    resolve_attention,
    sample_bounds,
    transformers_name,
    varlen_sdpa_forward,
)
from qlora_fsdp.layers.generation_attention import BLOCKWISE_GENERATION, generation_attention
from qlora_fsdp.losses.forward import ForwardLoss, loss_sum
from tests.helpers import assert_close_to_summation_order


def test_sample_bounds_start_wherever_the_position_does_not_go_up_by_one():
    positions = torch.tensor([0, 1, 2, 0, 1, 0, 0, 1, 2, 3])
    assert sample_bounds(positions) == [(0, 3), (3, 5), (5, 6), (6, 10)]
    assert sample_bounds(torch.arange(7)) == [(0, 7)]


def dense_reference(query, key, value, positions):
    """Causal attention within each sample, through one boolean block-diagonal mask."""
    segment = torch.stack([torch.cumsum((torch.diff(row, prepend=row[:1] + 1) != 1).long(), 0) for row in positions])
    n = positions.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask = (segment[:, :, None] == segment[:, None, :]) & causal
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None]).transpose(1, 2)


def test_per_sample_attention_equals_the_dense_mask_values_and_gradients():
    torch.manual_seed(0)
    rows = [[5, 17, 1, 9], [32]]  # sample lengths of two rows of 32 tokens; grouped-query heads (4 over 2)
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in rows])
    query = torch.randn(2, 4, 32, 8, requires_grad=True)
    key, value = (torch.randn(2, 2, 32, 8, requires_grad=True) for _ in range(2))
    ours, _ = varlen_sdpa_forward(torch.nn.Module(), query, key, value, None, position_ids=positions)
    reference = dense_reference(query, key, value, positions)
    # sample by sample against one masked row: the same sums over a row's 32 tokens in another order
    assert_close_to_summation_order(ours, reference, 32)
    weights = torch.randn_like(ours)
    grads = torch.autograd.grad((ours * weights).sum(), (query, key, value))
    expected = torch.autograd.grad((reference * weights).sum(), (query, key, value))
    for got, want in zip(grads, expected, strict=True):
        assert_close_to_summation_order(got, want, 32)


def window_mask(n: int, window: int | None) -> torch.Tensor:
    """transformers' additive mask for one sample: causal, and within `window` tokens where there is one."""
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (cols <= rows) & (cols > rows - window if window else torch.ones(n, n, dtype=torch.bool))
    return torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]


class FamilyAttention(torch.nn.Module):
    """What transformers' eager kernels read off the attention module."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.head_dim = heads // kv_heads, head_dim
        self.sinks = torch.nn.Parameter(torch.randn(heads))
        self.training = False


class WatchedOps(TorchDispatchMode):
    """While on (forward and backward): the most elements any op's output held (and any fp32 output), and the FLOPs
    the planner's op counter gives the ops."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.fp32_numel, self.flops = 0, 0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from qlora_fsdp.measure.op_work import op_work

        out = func(*args, **(kwargs or {}))
        tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.numel = max([self.numel, *(t.numel() for t in tensors)])
        self.fp32_numel = max([self.fp32_numel, *(t.numel() for t in tensors if t.dtype == torch.float32)])
        work = op_work(func, args, kwargs or {}, out, "step", False, None)
        self.flops += work.matmul_flops + work.attention_flops
        return out


# what each family's layer adds: gpt-oss sinks, Gemma 2 soft-capping, the rest a sliding window alone
FAMILY_OPTIONS = {"gpt_oss": "sinks", "gemma2": "softcap", "gemma3": None, "mistral": None, "qwen3": None}


@pytest.mark.parametrize("family", list(FAMILY_OPTIONS))
def test_per_sample_attention_computes_windows_sinks_and_soft_capping_as_the_family_defines_them(family,
                                                                                                  monkeypatch):
    """Packed rows (samples longer and shorter than the window, and than the kernel's block of 4 tokens) against
    transformers' own eager kernel of the family on each sample alone, values and gradients."""
    import importlib

    monkeypatch.setattr(blockwise, "BLOCK_TOKENS", 4)
    eager = importlib.import_module(f"transformers.models.{family}.modeling_{family}").eager_attention_forward
    torch.manual_seed(0)
    window, scaling = 6, 24**-0.5
    module = FamilyAttention(4, 2, 8)
    rows = [[5, 17, 10], [32]]
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in rows])
    query = torch.randn(2, 4, 32, 8, requires_grad=True)
    key, value = (torch.randn(2, 2, 32, 8, requires_grad=True) for _ in range(2))
    options = {"sinks": {"s_aux": module.sinks}, "softcap": {"softcap": 2.0}, None: {}}[FAMILY_OPTIONS[family]]
    ours, _ = varlen_sdpa_forward(module, query, key, value, None, scaling=scaling, sliding_window=window,
                                  position_ids=positions, **options)
    parts = []
    for row, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            piece = slice(start, start + n)
            out, _ = eager(module, query[row : row + 1, :, piece], key[row : row + 1, :, piece],
                           value[row : row + 1, :, piece], window_mask(n, window), scaling=scaling, **options)
            parts.append(out)
            start += n
    reference = torch.cat([torch.cat(parts[:3], dim=1), parts[3]])
    assert_close_to_summation_order(ours, reference, 32)  # 4-token blocks against each sample whole
    weights = torch.randn_like(ours)
    inputs = (query, key, value, module.sinks) if "s_aux" in options else (query, key, value)
    grads = torch.autograd.grad((ours * weights).sum(), inputs)
    expected = torch.autograd.grad((reference * weights).sum(), inputs)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [{"sliding_window": 16}, {"softcap": 2.0},
                                     {"s_aux": torch.zeros(4, dtype=torch.bfloat16)}])
def test_windows_soft_capping_and_sinks_never_hold_a_tokens_by_tokens_tensor(options, monkeypatch):
    """A 256-token bf16 sample through the forward and backward: no op's output reaches 256 x 256 elements (the dense
    kernel's scores were 4 x 256 x 256, its mask 256 x 256), and nothing in fp32 reaches the queries' size (only a
    block is cast up; the keys' and values' fp32 gradients, half the queries' size here, are the largest)."""
    monkeypatch.setattr(blockwise, "BLOCK_TOKENS", 16)
    n = 256
    query = torch.randn(1, 4, n, 8, dtype=torch.bfloat16, requires_grad=True)
    key, value = (torch.randn(1, 2, n, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    largest = WatchedOps()
    with largest:
        out, _ = varlen_sdpa_forward(FamilyAttention(4, 2, 8), query, key, value, None, scaling=0.3,
                                     position_ids=torch.arange(n)[None], **options)
        out.sum().backward()
    assert 0 < largest.numel < n * n
    assert 0 < largest.fp32_numel < query.numel(), (largest.fp32_numel, query.numel())
    assert query.grad is not None and key.grad is not None


def test_a_kernel_that_cannot_compute_the_family_is_never_picked_and_refused_when_asked_for(monkeypatch):
    sinks, softcap = AttentionNeeds("gpt_oss", sinks=True, sdpa=False), AttentionNeeds("gemma2", softcap=True,
                                                                                         sdpa=False)
    monkeypatch.setattr(attention_module, "flash_attn_installed", lambda: True)
    assert resolve_attention("auto", packing=False, device_type="cuda", needs=sinks) == VARLEN_SDPA
    assert resolve_attention("auto", packing=True, device_type="cuda", needs=sinks) == VARLEN_SDPA
    assert resolve_attention("auto", packing=False, device_type="cpu", needs=softcap) == VARLEN_SDPA
    assert resolve_attention("auto", packing=True, device_type="cuda", needs=softcap) == "flash_attention_2"
    with pytest.raises(ConfigError, match="cannot compute gemma2's attention .logit soft-capping.; use auto"):
        resolve_attention("sdpa", packing=False, device_type="cpu", needs=softcap)
    with pytest.raises(ConfigError, match="has no attention sinks, which gpt_oss needs"):
        resolve_attention("flash_attention_2", packing=True, device_type="cuda", needs=sinks)
    assert generation_attention("auto", sinks) == generation_attention("flash_attention_2", sinks) == (
        BLOCKWISE_GENERATION)
    assert generation_attention("auto", softcap) == BLOCKWISE_GENERATION and generation_attention("auto") == "sdpa"
    assert generation_attention("eager", softcap) == "eager"  # asked for: as it is
    # Llama 4's chunked layers: our kernel cuts each sample into chunks; flash and flex do not, nor do transformers'
    # masks of a packed row (chunks counted from the row's start)
    chunked = AttentionNeeds("llama4_text", chunked=True, row_position_scaling_from=8191)
    assert resolve_attention("auto", packing=True, device_type="cuda", needs=chunked) == VARLEN_SDPA
    assert resolve_attention("sdpa", packing=False, device_type="cuda", needs=chunked) == "sdpa"
    for choice, packing in (("flash_attention_2", False), ("sdpa", True), ("eager", True)):
        with pytest.raises(ConfigError, match="does not keep llama4_text's chunked-attention layers to their chunks"):
            resolve_attention(choice, packing=packing, device_type="cuda", needs=chunked)
    refuse_row_position_scaling(chunked, several_samples_a_row=True, context_length=8191)
    refuse_row_position_scaling(chunked, several_samples_a_row=False, context_length=16384)
    with pytest.raises(ConfigError, match="set data.context_length to 8191 or less, or data.packing: false"):
        refuse_row_position_scaling(chunked, several_samples_a_row=True, context_length=8192)


def test_attention_dropout_is_applied_as_transformers_sdpa_applies_it_and_refused_where_our_kernel_has_none():
    """Seed-OSS trains with attention_dropout 0.1: in training, a sample alone in its row drops the same
    probabilities as transformers' sdpa under the same seed (one call of the same shape), and a packed row's samples
    those of transformers' calls one sample at a time. Where the family needs the blockwise kernel (windows,
    soft-capping, sinks), dropout is refused at load in one line."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, scaling = torch.nn.Module(), 8 ** -0.5
    query, key, value = (torch.randn(1, 4, 12, 8) for _ in range(3))

    def ours(positions: list[int], dropout: float) -> torch.Tensor:
        torch.manual_seed(0)
        return varlen_sdpa_forward(module, query, key, value, None, scaling, dropout,
                                   position_ids=torch.tensor([positions]))[0]

    def theirs(bounds: list[tuple[int, int]], dropout: float) -> torch.Tensor:
        torch.manual_seed(0)
        return torch.cat([sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                                 dropout, scaling)[0] for a, b in bounds], dim=1)

    alone, packed = list(range(12)), [*range(7), *range(5)]
    assert torch.equal(ours(alone, 0.1), theirs([(0, 12)], 0.1))
    assert torch.equal(ours(packed, 0.1), theirs([(0, 7), (7, 12)], 0.1))
    assert not torch.allclose(ours(packed, 0.1), ours(packed, 0.0))  # probabilities were dropped
    assert torch.equal(ours(packed, 0.0), theirs([(0, 7), (7, 12)], 0.0))
    plain = AttentionNeeds("seed_oss", dropout=0.1)
    assert resolve_attention("auto", packing=True, device_type="cpu", needs=plain) == VARLEN_SDPA
    windowed = AttentionNeeds("mistral", windowed=True, dropout=0.1)
    with pytest.raises(ConfigError, match="mistral's config.json sets attention_dropout 0.1, which sdpa_varlen "
                                          "applies to plain causal attention only"):
        resolve_attention("auto", packing=True, device_type="cpu", needs=windowed)
    assert resolve_attention("auto", packing=False, device_type="cpu", needs=windowed) == "sdpa"  # transformers'


def test_per_sample_attention_refuses_a_kv_cache():
    query, key = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 5, 4)
    with pytest.raises(RuntimeError, match="generate with sdpa"):
        varlen_sdpa_forward(torch.nn.Module(), query, key, key, None)


def test_auto_picks_per_sample_attention_for_packed_rows_only(monkeypatch):
    monkeypatch.setattr(attention_module, "flash_attn_installed", lambda: False)
    assert resolve_attention("auto", packing=True, device_type="cpu") == VARLEN_SDPA
    assert resolve_attention("auto", packing=True, device_type="cuda") == VARLEN_SDPA
    assert resolve_attention("auto", packing=False, device_type="cuda") == "sdpa"
    assert resolve_attention("eager", packing=True, device_type="cpu") == "eager"
    assert resolve_attention("flex_attention", packing=True, device_type="cuda") == "flex_attention"
    with pytest.raises(ConfigError, match="cannot train on CPU"):
        resolve_attention("flex_attention", packing=True, device_type="cpu")
    with pytest.raises(ConfigError, match="needs the flash-attn package"):
        resolve_attention("flash_attention_2", packing=True, device_type="cuda")
    monkeypatch.setattr(attention_module, "flash_attn_installed", lambda: True)
    assert resolve_attention("auto", packing=True, device_type="cuda") == "flash_attention_2"
    assert resolve_attention("auto", packing=True, device_type="cpu") == VARLEN_SDPA


def test_generation_never_runs_per_sample_attention():
    assert generation_attention(VARLEN_SDPA) == "sdpa" and generation_attention("auto") == "sdpa"
    assert generation_attention("flash_attention_2") == "flash_attention_2"


def tiny_generation_model(family: str):
    """A random 2-layer transformers model of a family generation runs blockwise: gpt-oss (sinks, a window of 8)
    or Gemma 2 (soft-capping, a window of 8)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"])
    if family == "gpt_oss":
        model = GptOssForCausalLM(GptOssConfig(num_local_experts=4, num_experts_per_tok=2, **common))
        with torch.no_grad():  # sinks far enough from 0 to matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 2)
        return model.eval()
    return Gemma2ForCausalLM(Gemma2Config(attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                          **common)).eval()


@pytest.mark.parametrize("family", ["gpt_oss", "gemma2"])
def test_generation_of_capped_and_sink_families_equals_eager_with_the_prompt_in_linear_memory(family, monkeypatch):
    """Left-padded prompts of 40 and 23 tokens (past the window of 8) with a static cache, greedy: the blockwise
    prompt forward and eager decoding steps give eager attention's tokens and scores; a 128-token prompt's forward
    in 16-token blocks holds no heads x tokens x tokens tensor (eager's scores are one; a boolean mask of tokens x
    tokens may stay)."""
    from transformers import StaticCache

    model = tiny_generation_model(family)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=generator) for n in (40, 23)]
    ids = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros(2, 40, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding
        ids[row, 40 - len(prompt) :], mask[row, 40 - len(prompt) :] = prompt, 1
    runs = {}
    for kernel in ("eager", BLOCKWISE_GENERATION):
        model.config._attn_implementation = kernel
        cache = StaticCache(config=model.config, max_cache_len=64)
        runs[kernel] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                      past_key_values=cache, pad_token_id=0, output_scores=True,
                                      return_dict_in_generate=True)
    eager, ours = runs["eager"], runs[BLOCKWISE_GENERATION]
    assert torch.equal(ours.sequences, eager.sequences)
    for mine, theirs in zip(ours.scores, eager.scores, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(blockwise, "BLOCK_TOKENS", 16)
    n, watched = 128, WatchedOps()
    with torch.no_grad(), watched:
        model(input_ids=torch.randint(3, 300, (1, n), generator=generator), use_cache=True)
    assert watched.numel < 4 * n * n  # the kernel's blocks: at most a block of scores


@pytest.fixture(scope="module")
def packed_and_alone(tiny_model_dir):
    generator = torch.Generator().manual_seed(3)
    lengths = [40, 7, 90, 23, 61, 12]
    samples = []
    for n in lengths:
        ids = torch.randint(5, 500, (n,), generator=generator).tolist()
        labels = [-100] * (n // 3) + ids[n // 3 :]  # a masked prompt, then targets
        samples.append(Sample(ids, labels))
    return samples, collate_packed([samples[:3], samples[3:]], pad_id=0)


@pytest.mark.parametrize("kernel", ["sdpa", "eager", VARLEN_SDPA])
def test_training_loss_and_gradients_of_a_packed_batch_are_the_same_under_every_kernel(tiny_model_dir,
                                                                                       packed_and_alone, kernel):
    samples, packed = packed_and_alone
    reference_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                           attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=kernel)
    alone = sum(loss_sum(reference_model, collate([s], pad_id=0), torch.device("cpu")) for s in samples)
    chunked = ForwardLoss(chunk_tokens=64)(model, packed, torch.device("cpu"))  # training's loss: target rows only
    torch.testing.assert_close(chunked, alone, rtol=1e-5, atol=1e-4)
    chunked.backward()
    alone.backward()
    for (name, got), want in zip(model.named_parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_bounds_from_the_batch_lengths_equal_those_read_from_the_position_ids(packed_and_alone):
    _, packed = packed_and_alone
    for one_row in (False, True):
        positions = packed.position_ids.view(1, -1) if one_row else packed.position_ids
        assert packed.sample_bounds(one_row) == [sample_bounds(row) for row in positions]


@pytest.mark.old_torch  # reaches torch code that differs between releases (tests/version_paths.py)
def test_the_planner_runs_one_block_pair_and_counts_the_work_of_them_all(monkeypatch):
    """On fake tensors the blockwise kernel runs its first block pair only (a 64k-token row would take thousands):
    the planner's count of the step's FLOPs is the kernel's, all pairs run, forward and backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(blockwise, "BLOCK_TOKENS", 16)

    def counted(make):
        query = make(torch.randn(2, 4, 70, 8)).requires_grad_()
        key, value = (make(torch.randn(2, 2, 70, 8)).requires_grad_() for _ in range(2))
        counter = WatchedOps()
        with counter:
            out = blockwise.blockwise_attention(query, key, value, 0.3, window=24, softcap=2.0)
            out.sum().backward()
        return counter.flops

    real = counted(lambda t: t)
    with FakeTensorMode() as fake_mode:
        planned = counted(fake_mode.from_tensor)
    assert real > 0 and planned == pytest.approx(real, rel=1e-9)


# ---- flex attention: short grouped-query rows compile, a failed compile falls back -----------------------------

def test_flex_short_queries_take_the_main_kernel():
    """Under 128 queries inductor would pick its flex-decoding kernel, which rejects grouped-query rows on CUDA."""
    from qlora_fsdp.layers.flex_attention import kernel_options

    def options(queries: int, given: dict | None = None) -> dict:
        return kernel_options(torch.empty(1, 4, queries, 8, device="meta"), given)

    assert options(1) == options(127) == {"FORCE_USE_FLEX_ATTENTION": True}
    assert options(128) == {} and options(1, {"BACKEND": "TRITON"}) == {"BACKEND": "TRITON"}
    assert options(1, {"FORCE_USE_FLEX_ATTENTION": False}) == {"FORCE_USE_FLEX_ATTENTION": False}


class NoValidChoices(torch._dynamo.exc.TorchDynamoException):
    """Stands for inductor's lowering failure seen on the H200 (InductorError: ... NoValidChoicesError)."""


@pytest.mark.old_torch  # reaches torch code that differs between releases (tests/version_paths.py)
def test_flex_that_fails_to_compile_falls_back_in_one_line(tiny_model_dir, monkeypatch, capsys):
    """The compiled call fails: the same call runs torch's uncompiled flex attention (the logits of sdpa, grouped
    queries and a short row), the log says so once, and later calls go straight there."""
    from transformers.integrations import flex_attention as transformers_flex

    from qlora_fsdp.layers import flex_attention as flex

    compiles = []

    def failing_compile(self):
        def compiled(*args, **kwargs):
            compiles.append(kwargs["kernel_options"])
            raise NoValidChoices("LoweringException: NoValidChoicesError: No choices to select\nsecond line")
        return compiled

    monkeypatch.setattr(transformers_flex.WrappedFlexAttention, "__call__", failing_compile)
    monkeypatch.setattr(flex._State, "fallback_reason", None)
    ids = torch.tensor([[5, 9, 14, 3, 7, 22, 41]])
    logits = {}
    for kernel in ("sdpa", "flex_attention"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                     attn_implementation=transformers_name(kernel))
        with torch.no_grad():
            logits[kernel] = model(input_ids=ids).logits
            again = model(input_ids=ids).logits
    torch.testing.assert_close(logits["flex_attention"], logits["sdpa"], rtol=1e-5, atol=1e-5)
    assert torch.equal(again, logits["flex_attention"])
    assert compiles == [{"FORCE_USE_FLEX_ATTENTION": True}]  # tried once, with the short rows' option
    lines = [line for line in capsys.readouterr().err.splitlines() if "flex" in line]  # not the loading bars
    assert lines == ["warning: flex attention did not compile (LoweringException: NoValidChoicesError: No choices "
                     "to select); this process now runs torch's uncompiled flex attention (exact, slower, scores "
                     "held whole)"]


def test_flex_whose_backward_fails_to_compile_falls_back_at_the_first_forward(monkeypatch, capsys):
    """The backward compiles in the loss's backward, outside the forward's guard: the first forward that will need
    one tries a forward and backward on copies, so the failure is caught there, said once, and the fallback is
    taken before training ever runs a backward that could not compile."""
    from transformers.integrations import flex_attention as transformers_flex

    from qlora_fsdp.layers import flex_attention as flex

    class FailingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query):
            return query.clone()

        @staticmethod
        def backward(ctx, grad):
            raise NoValidChoices("LoweringException: NoValidChoicesError: the backward's kernel")

    calls = []

    def forward(module, query, key, value, mask, **kwargs):
        calls.append("uncompiled" if transformers_flex.is_torchdynamo_compiling() else "compiled")
        return FailingBackward.apply(query).transpose(1, 2), None

    monkeypatch.setattr(transformers_flex, "flex_attention_forward", forward)
    monkeypatch.setattr(flex._State, "fallback_reason", None)
    monkeypatch.setattr(flex._State, "backward_tried", False)
    query = torch.randn(1, 4, 6, 8, requires_grad=True)
    key = torch.randn(1, 2, 6, 8)
    out, _ = flex.guarded_flex_forward(torch.nn.Module(), query, key, key, None)
    assert calls == ["compiled", "uncompiled"] and out.shape == (1, 6, 4, 8)
    flex.guarded_flex_forward(torch.nn.Module(), query, key, key, None)
    assert calls[2:] == ["uncompiled"]  # the rest of the process runs the fallback
    lines = [line for line in capsys.readouterr().err.splitlines() if "flex" in line]
    assert len(lines) == 1 and "the backward's kernel" in lines[0]
    monkeypatch.setattr(flex._State, "fallback_reason", None)
    calls.clear()

    def checkpointed(query):
        return flex.guarded_flex_forward(torch.nn.Module(), query, key, key, None)[0]

    torch.utils.checkpoint.checkpoint(checkpointed, query, use_reentrant=False)
    assert calls == ["compiled"]  # no trial inside checkpoint's saved-tensor hooks
