"""PiSSA (exact and randomized SVD), OLoRA and LoftQ on the 4-bit sharded base, computed from the full-precision
weights while they load: A and B equal PEFT's own init (on transformers' fp32 model; LoftQ's on its bitsandbytes
alternation), the 4-bit residual is within one NF4 step of PEFT's residual, two ranks hold what one does; the saved
rank-2r adapter is PEFT's conversion to the original base, and merged it gives the live model's logits."""

from __future__ import annotations

import inspect
import json
import zlib

import bitsandbytes.functional as bnbf
import pytest
import torch
from torch.distributed.tensor import DTensor

from qlora_fsdp.config import to_yaml
from qlora_fsdp.loading.adapter import export_adapter, gather_trainable_state
from qlora_fsdp.loading.checkpoint import load_tokenizer
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.loading.names import clean_name, weight_key
from tests.helpers import add_whole, command_here, relative_difference, run_ranks_sequence, tiny_config

pytestmark = pytest.mark.slow  # gloo ranks

INITS = ("pissa", "pissa_niter_2", "olora", "loftq")
R, SEED = 8, 42
NF4_WIDEST_STEP = 0.3038  # the widest gap between two NF4 levels (-1 and -0.6962), in units of a block's absmax


def init_config(model_dir, init):
    # LoftQ at alpha = r: PEFT's unscaled factors are then its start (see layers/lora_inits.py); no double
    # quantization: PEFT's LoftQ quantizes without it
    alpha = R if init == "loftq" else 2 * R
    return tiny_config(model_dir, lora={"init": init, "r": R, "alpha": alpha, "loftq_iter": 2, "dropout": 0.0},
                       quant={"double_quant": init != "loftq"})


def dequantized_bases(model) -> dict[str, torch.Tensor]:
    """Every 4-bit linear's weight as the model computes with it, by checkpoint key (gathered whole)."""
    import bitsandbytes as bnb

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            packed = module.weight
            full = packed.full_tensor() if isinstance(packed, DTensor) else packed.data
            out[weight_key(name + ".weight")] = bnbf.dequantize_4bit(full, module.quant_state).float().cpu()
    return out


def nudge(model) -> None:
    """Move A and B off their start (as training would), the same whatever the sharding."""
    for name, param in model.named_parameters():
        if "lora_" in name:
            add_whole(param, 0.01 * torch.cos(torch.arange(param.numel(), dtype=torch.float32)).view(param.shape))


def loaded_inits(info, model_dir, adapter_root):
    """Each init's A, B and 4-bit base as loaded; for PiSSA, the adapter after a nudge, saved, and the live logits."""
    results = {}
    for init in INITS:
        cfg = init_config(model_dir, init)
        model = build_sharded_model(cfg, info)
        results[init] = {"adapter": gather_trainable_state(model), "bases": dequantized_bases(model)}
        if init in ("pissa", "loftq"):
            nudge(model)
            ids = torch.tensor([load_tokenizer(cfg)("The capital of Peru is Lima.")["input_ids"]])
            with torch.no_grad():
                results[init]["logits"] = model(input_ids=ids.to(info.device)).logits[0].float().cpu()
            results[init]["ids"] = ids
            export_adapter(model, load_tokenizer(cfg), adapter_root / init, cfg.model.path, info.is_main, to_yaml(cfg))
    return results


def reloaded_logits(info, model_dir, adapter_root):
    """Each saved adapter loaded back as generation loads it (the start computed again, the trained halves put
    into it): the logits of the same text."""
    from qlora_fsdp.loading.adapter import load_adapter_into

    out = {}
    for init in ("pissa", "loftq"):
        cfg = init_config(model_dir, init)
        model = build_sharded_model(cfg, info)
        load_adapter_into(model, adapter_root / init)
        ids = torch.tensor([load_tokenizer(cfg)("The capital of Peru is Lima.")["input_ids"]])
        with torch.no_grad():
            out[init] = model(input_ids=ids.to(info.device)).logits[0].float().cpu()
    return out


def peft_loftq_on_cpu():
    """PEFT's own loftq_init, its compute device (CUDA or XPU only) set to the CPU."""
    from peft.utils import loftq_utils

    source = inspect.getsource(loftq_utils.loftq_init.__wrapped__ if hasattr(loftq_utils.loftq_init, "__wrapped__")
                               else loftq_utils.loftq_init)
    source = source.replace('"xpu" if is_xpu_available() else "cuda"', '"cpu"').replace("@torch.no_grad()\n", "")
    namespace = dict(vars(loftq_utils))
    exec(compile(source, loftq_utils.__file__, "exec"), namespace)  # noqa: S102 (PEFT's source, one line changed)
    return namespace["loftq_init"]


def peft_starts(model_dir, init) -> dict[str, dict[str, torch.Tensor]]:
    """PEFT's A, B and residual for every LoRA layer of transformers' fp32 model, layer by layer; the randomized SVD
    seeded per weight as our loader seeds it."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    alpha = R if init == "loftq" else 2 * R
    peft_model = get_peft_model(model, LoraConfig(r=R, lora_alpha=alpha, target_modules="all-linear"))
    loftq_init = peft_loftq_on_cpu() if init == "loftq" else None
    out = {}
    for name, layer in peft_model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        key = weight_key(name + ".weight")
        weight = layer.get_base_layer().weight
        if init == "loftq":
            base, a, b = loftq_init(weight.data, num_bits=4, reduced_rank=R, num_iter=2)
        else:
            torch.manual_seed(SEED * 1_000_003 + zlib.crc32(key.encode()))
            layer.pissa_init("default", init) if init.startswith("pissa") else layer.olora_init("default")
            a, b, base = layer.lora_A["default"].weight.data, layer.lora_B["default"].weight.data, weight.data
        out[clean_name(name)] = {"a": a.clone(), "b": b.clone(), "base": base.clone(), "key": key}
    return out


@pytest.fixture(scope="module")
def init_runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("inits")
    runs = {}
    for ws in (1, 2):
        folder = root / f"ws{ws}"
        calls = [(loaded_inits, (tiny_model_dir, folder)), (reloaded_logits, (tiny_model_dir, folder))]
        runs[ws], reloaded = run_ranks_sequence(calls, ws, tmp_path_factory.mktemp(f"inits{ws}"))
        for init, logits in reloaded.items():
            runs[ws][init]["reloaded"] = logits
    return runs, root


@pytest.mark.parametrize("init", INITS)
def test_inits_equal_peft_and_the_4bit_residual_is_within_one_nf4_step(tiny_model_dir, init_runs, init):
    runs, _ = init_runs
    theirs = peft_starts(tiny_model_dir, init)
    ours = runs[1][init]
    for layer, start in theirs.items():
        a, b = ours["adapter"][f"{layer}.lora_A.default.weight"], ours["adapter"][f"{layer}.lora_B.default.weight"]
        assert relative_difference({"a": a, "b": b}, {"a": start["a"], "b": start["b"]}) <= 1e-5, layer
        base, reference = ours["bases"][start["key"]], start["base"]
        if init == "loftq":  # PEFT's base is already its 4-bit round trip: the same bytes
            torch.testing.assert_close(base, reference, rtol=0, atol=0)
        else:
            absmax = reference.flatten().view(-1, 64).abs().amax(1, keepdim=True)
            step = (NF4_WIDEST_STEP * absmax).expand(-1, 64).reshape(reference.shape)
            assert ((base - reference).abs() <= step).all(), layer
            assert (base - reference).abs().max() > 0  # it is 4-bit, not the fp32 residual
    sharded = runs[2][init]
    assert relative_difference(sharded["adapter"], ours["adapter"]) <= 1e-6
    assert all(torch.equal(sharded["bases"][k], v) for k, v in ours["bases"].items())


@pytest.mark.parametrize("init", ["pissa", "loftq"])
def test_the_saved_adapter_is_peft_rank_2r_and_merges_to_the_live_logits(tiny_model_dir, init_runs, init, tmp_path):
    """The adapter saved after A and B moved: rank 2r on the original base (PEFT's conversion); merged (float32), a
    plain checkpoint whose logits are the live 4-bit model's."""
    from transformers import AutoModelForCausalLM

    from qlora_fsdp.commands.merge import main as merge_main

    runs, root = init_runs
    adapter = root / "ws2" / init
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["init_lora_weights"]) == (2 * R, True)
    merged = command_here(merge_main, ["--adapter", adapter, "--out", tmp_path / "merged", "--dtype", "float32"])
    assert merged.returncode == 0, merged.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    live = runs[2][init]
    with torch.no_grad():
        logits = model(input_ids=live["ids"]).logits[0]
    assert relative_difference({"l": logits}, {"l": live["logits"]}) <= 1e-5
    assert relative_difference({"l": live["reloaded"]}, {"l": live["logits"]}) <= 1e-6  # as generation loads it


def real_pissa_adapter(info, model_dir, out):
    """SmolLM2 loaded with a randomized-SVD PiSSA start, A and B moved, saved; the live model's logits."""
    cfg = tiny_config(model_dir, lora={"init": "pissa_niter_4", "r": R, "alpha": 2 * R, "dropout": 0.0})
    model = build_sharded_model(cfg, info)
    nudge(model)
    ids = torch.tensor([load_tokenizer(cfg)("The capital of Peru is Lima.")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    export_adapter(model, load_tokenizer(cfg), out, cfg.model.path, info.is_main, to_yaml(cfg))
    return ids, logits


def test_a_pissa_adapter_of_a_real_model_exports_to_gguf(short_real_model_dir, tmp_path):
    """SmolLM2's PiSSA adapter exported (merged as trained, then llama.cpp's converter, f16): the GGUF read back by
    transformers gives the live 4-bit model's logits to float16's rounding."""
    from gguf import GGUFReader  # noqa: F401 (the export's own dependency: present)
    from transformers import AutoModelForCausalLM

    from qlora_fsdp.commands.export import main as export_main

    ids, live = run_ranks_sequence([(real_pissa_adapter, (short_real_model_dir, tmp_path / "adapter"))], 1, tmp_path)[0]
    exported = command_here(export_main, ["--adapter", tmp_path / "adapter", "--out", tmp_path / "gguf"])
    assert exported.returncode == 0, exported.stderr[-2000:]
    (gguf,) = list((tmp_path / "gguf").glob("*.gguf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits[0]
    assert relative_difference({"l": logits}, {"l": live}) <= 5e-3


def test_loftq_starts_at_the_weight_at_any_alpha():
    """LoftQ's factors divided by sqrt(alpha/r): the start scale * B A is PEFT's L R whatever alpha, so 4-bit base plus
    start is closer to the weight than the 4-bit base alone (PEFT's unscaled factors would double it at alpha = 2r)."""
    from qlora_fsdp.config import QuantConfig
    from qlora_fsdp.layers.lora_inits import initial_adapter
    from qlora_fsdp.loading.initial_adapter import round_trip

    weight = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    rounding = round_trip(QuantConfig(double_quant=False), torch.float32)
    at_one, at_two = (initial_adapter("loftq", weight, R, scale, torch.float32, 0, 2, rounding) for scale in (1.0, 2.0))
    torch.testing.assert_close(2.0 * (at_two.b @ at_two.a), at_one.b @ at_one.a)
    base = rounding(at_two.base)
    assert (weight - base - 2.0 * at_two.b @ at_two.a).norm() < 0.8 * (weight - base).norm()


def eva_on_our_model(info, model_dir, per_rank):
    """EVA's start on the sharded 4-bit model from this rank's micro-batches (every rank's gathered)."""
    from qlora_fsdp.training.eva_start import eva_inputs, eva_start

    cfg = tiny_config(model_dir, lora={"init": "eva", "r": R, "alpha": 2 * R, "dropout": 0.0})
    model = build_sharded_model(cfg, info)
    filled = eva_start(model, [eva_inputs(model, batch, info.device) for batch in per_rank[info.rank]])
    return filled, gather_trainable_state(model)


def test_eva_starts_as_peft_eva_on_the_same_micro_batches(tiny_model_dir, tmp_path):
    """Every A is PEFT's initialize_lora_eva_weights' (rho 1) on transformers + bitsandbytes NF4 fed the same
    micro-batches, one rank or two (their inputs gathered); every B stays zero."""
    from peft import EvaConfig, LoraConfig, get_peft_model
    from peft.tuners.lora.eva import initialize_lora_eva_weights

    from qlora_fsdp.data.batching import collate
    from qlora_fsdp.labels import IGNORE_INDEX
    from tests.helpers import transformers_nf4, variable_length_samples

    cfg = tiny_config(tiny_model_dir)
    samples = variable_length_samples(cfg, 16)
    pad = load_tokenizer(cfg).pad_token_id
    # micro-batch i: rank 0 takes samples 8i..8i+3, rank 1 8i+4..8i+7 (gathered in that order); one rank takes all 8
    per_rank = [[collate(samples[8 * i + 4 * rank : 8 * i + 4 * rank + 4], pad) for i in range(2)] for rank in (0, 1)]
    whole = [collate(samples[8 * i : 8 * i + 8], pad) for i in range(2)]
    one = run_ranks_sequence([(eva_on_our_model, (tiny_model_dir, [whole]))], 1, tmp_path)[0]
    two = run_ranks_sequence([(eva_on_our_model, (tiny_model_dir, per_rank))], 2, tmp_path)[0]

    model = get_peft_model(transformers_nf4(tiny_model_dir), LoraConfig(
        r=R, lora_alpha=2 * R, target_modules="all-linear", init_lora_weights="eva", eva_config=EvaConfig(rho=1.0)))
    loader = [{"input_ids": b.input_ids, "attention_mask": b.attention_mask,  # PEFT masks by unshifted labels
               "labels": torch.tensor([[IGNORE_INDEX] + row[:-1] for row in b.labels.tolist()])} for b in whole]
    initialize_lora_eva_weights(model, loader, show_progress_bar=False)
    theirs = {name: p.detach() for name, p in model.named_parameters() if "lora_A" in name}
    for filled, ours in (two,):
        assert filled == len(theirs)
        assert relative_difference({k: ours[k] for k in theirs}, theirs) <= 1e-5
        assert all(not ours[k].any() for k in ours if "lora_B" in k)
    assert relative_difference(one[1], two[1]) <= 1e-5
