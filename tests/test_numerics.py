"""Sharded vs unsharded, accumulated vs one batch, checkpointed vs not: the numbers must agree."""

from __future__ import annotations

import itertools

import bitsandbytes as bnb
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch.distributed.fsdp import FSDPModule

from qlora_fsdp.data.pipeline import IGNORE_INDEX
from qlora_fsdp.distributed.grad_sync import set_gradient_sync
from qlora_fsdp.dtypes import TORCH_DTYPES
from qlora_fsdp.loading.adapter import gather_trainable_state
from qlora_fsdp.loading.checkpoint import model_dir
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.loading.names import weight_key
from qlora_fsdp.loading.weight_files import weight_files
from qlora_fsdp.objectives.supervised import accumulate_gradients
from tests.cuda_copy import cuda_bf16_copy_emulated
from tests.helpers import (
    FSDP2_REDUCE_SCATTER,
    batches,
    fsdp_params,
    full_grads,
    relative_difference,
    run_ranks,
    run_ranks_sequence,
    tiny_config,
    variable_length_samples,
)

pytestmark = pytest.mark.slow  # every test runs gloo ranks

PAD = 2


# ---- functions run inside the ranks -------------------------------------------------------------

def loss_and_grads(info, cfg, micro_batches_per_rank, shard=True):
    model = build_sharded_model(cfg, info, shard=shard)
    result = accumulate_gradients(model, micro_batches_per_rank[info.rank], info.device)
    return {"loss": result.loss, "grads": full_grads(model)}


def offloaded_parameters(model):
    """How many parameters FSDP2 keeps in host memory between uses (its CPU-offload policy)."""
    return sum(fsdp_param.offload_to_cpu for fsdp_param in fsdp_params(model))


def clipped_update(info, cfg, micro_batches_per_rank, shard=True, sgd=True):
    """One step as training takes it: accumulate, clip to a norm small enough to clip, update (plain SGD, whose
    update is the clipped gradient itself, or the recipe's optimizer over the local shards). Loss, gradients,
    global norm and the change of every LoRA weight, gathered."""
    from qlora_fsdp.optimizer import build_optimizer, clip_grad_norm

    model = build_sharded_model(cfg, info, shard=shard)
    before = gather_trainable_state(model)
    result = accumulate_gradients(model, micro_batches_per_rank[info.rank], info.device)
    grads = full_grads(model)
    norm = clip_grad_norm(model, 1e-3)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.1) if sgd else build_optimizer(model, cfg.optim, cfg.lora)
    optimizer.step()
    after = gather_trainable_state(model)
    return {"loss": result.loss, "grads": grads, "norm": norm, "delta": {k: after[k] - before[k] for k in before},
            "offloaded": offloaded_parameters(model), "optimizer": type(getattr(optimizer, "inner", optimizer))}


def trainer_step_and_reference(info, cfg):
    """Trainer.train_step over several micro-batches, and by hand on a second model: one accumulated gradient,
    one clip, one optimizer step. Both end states, the optimizer's step counts and the gradients left over."""
    from qlora_fsdp.api import make_trainer
    from qlora_fsdp.data.pipeline import load_dataset
    from qlora_fsdp.loading.checkpoint import load_tokenizer
    from qlora_fsdp.optimizer import build_optimizer, build_scheduler, clip_grad_norm

    tokenizer = load_tokenizer(cfg)
    data = load_dataset(tokenizer, cfg.data, cfg.train.seed, info)
    trainer = make_trainer(cfg, info, build_sharded_model(cfg, info), data, tokenizer)
    position = trainer.sampler.state_dict()
    micro_batches = trainer.micro_batches()  # the very batches train_step will draw
    trainer.sampler.load_state_dict(position)

    reference = build_sharded_model(cfg, info)
    optimizer = build_optimizer(reference, cfg.optim, cfg.lora)
    build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)  # sets the warm-up lr, as the trainer's does
    accumulate_gradients(reference, micro_batches, info.device)
    clip_grad_norm(reference, cfg.optim.max_grad_norm)
    optimizer.step()

    trainer.train_step()
    left = sum(p.grad is not None for p in trainer.model.parameters())
    left += sum(local.grad is not None for local in trainer.optimizer.locals)
    return {"trainer": gather_trainable_state(trainer.model), "reference": gather_trainable_state(reference),
            "optimizer_steps": {int(state["step"]) for state in trainer.optimizer.inner.state.values()},
            "grads_left": left, "micro_batches": len(micro_batches)}


def loss_and_grads_on_cuda_copies(info, cfg, micro_batches_per_rank, storage=None):
    """loss_and_grads with FSDP2's copy-in behaving as on CUDA; `storage` overrides the packed 4-bit dtype
    (the model module's constant, which loading follows) to show what the old bf16 storage did."""
    import qlora_fsdp.loading.build

    saved = qlora_fsdp.loading.build.QUANT_STORAGE
    qlora_fsdp.loading.build.QUANT_STORAGE = storage or saved
    try:
        with cuda_bf16_copy_emulated():
            return loss_and_grads(info, cfg, micro_batches_per_rank)
    finally:
        qlora_fsdp.loading.build.QUANT_STORAGE = saved  # the pool's worker serves other tests next


def hsdp_and_fsdp_steps(info, cfg, micro_batches_per_rank, shard_size):
    """The same step on a 2-D mesh (replicas x shards) and on the plain 1-D mesh of the same ranks: loss,
    gradients, clipped norm and an SGD update of each."""
    import dataclasses

    from qlora_fsdp.distributed import data_parallel_mesh, local_shard
    from qlora_fsdp.optimizer import clip_grad_norm

    results = []
    for size in (shard_size, None):
        mesh_info = dataclasses.replace(info, mesh=data_parallel_mesh("cpu", info.world_size, size))
        model = build_sharded_model(cfg, mesh_info)
        shard_shapes = {n: tuple(local_shard(p).shape) for n, p in model.named_parameters() if p.requires_grad}
        before = gather_trainable_state(model)
        result = accumulate_gradients(model, micro_batches_per_rank[info.rank], info.device)
        grads = full_grads(model)
        norm = clip_grad_norm(model, 1e-3)  # small enough to clip: the scaling uses the global norm
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
        after = gather_trainable_state(model)
        results.append({"loss": result.loss, "grads": grads, "norm": norm, "mesh": tuple(mesh_info.mesh.shape),
                        "delta": {k: after[k] - before[k] for k in before}, "shard_shapes": shard_shapes})
    return results


def naive_mean_of_means(info, cfg, micro_batches_per_rank):
    """What a per-micro-batch mean loss (HF Trainer style) computes: kept to show the check can fail."""
    model = build_sharded_model(cfg, info)
    mine = micro_batches_per_rank[info.rank]
    for batch in mine:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE_INDEX)
        (loss / len(mine) / info.world_size).backward()
    return {"grads": full_grads(model)}


def sgd_update(info, cfg, micro_batches_per_rank):
    model = build_sharded_model(cfg, info)
    before = gather_trainable_state(model)
    accumulate_gradients(model, micro_batches_per_rank[info.rank], info.device)
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    after = gather_trainable_state(model)
    return {"delta": {k: after[k] - before[k] for k in before}}


def count_reduce_scatters(info, cfg, micro_batches_per_rank):
    """Reduce-scatter calls for one step with accumulation, and with a sync after every micro-batch."""
    calls = {"n": 0}
    original = getattr(dist, FSDP2_REDUCE_SCATTER)

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    setattr(dist, FSDP2_REDUCE_SCATTER, counting)
    try:
        model = build_sharded_model(cfg, info)
        accumulate_gradients(model, micro_batches_per_rank[info.rank], info.device)
        with_accumulation = calls["n"]
        model.zero_grad(set_to_none=True)
        calls["n"] = 0
        for batch in micro_batches_per_rank[info.rank]:
            set_gradient_sync(model, True)
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.sum().backward()
        every_micro_batch = calls["n"]
    finally:
        setattr(dist, FSDP2_REDUCE_SCATTER, original)
    groups = sum(1 for m in model.modules() if isinstance(m, FSDPModule) and any(
        p.requires_grad for p in m.parameters()) and m is not model)
    return {"accumulated": with_accumulation, "every_micro_batch": every_micro_batch, "layer_groups": groups}


def packed_weights_match(info, cfg, literal):
    """Each 4-bit weight, all-gathered by FSDP2's own unshard, against bitsandbytes' quantize_4bit of the
    checkpoint tensor called with `literal` settings (not through our code): the bytes, the absmax (nested too)
    and the state's blocksize, quant type and nesting."""
    model = build_sharded_model(cfg, info)
    originals = {}
    for file in weight_files(model_dir(cfg)):
        with safe_open(file, framework="pt") as reader:
            originals.update({k: reader.get_tensor(k) for k in reader.keys()})
    layers = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    for layer in layers:
        layer.unshard()  # the all-gather a forward does
    checked, identical, settings = 0, 0, set()
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            original = originals[weight_key(f"{name}.weight")].to(TORCH_DTYPES[cfg.model.dtype])
            packed, state = bnb.functional.quantize_4bit(original, quant_storage=torch.uint8, **literal)
            ours = module.quant_state
            settings.add((ours.blocksize, ours.quant_type, ours.nested, module.weight.dtype))
            same_bytes = torch.equal(module.weight.detach().view(torch.uint8), packed)
            same_state = torch.equal(ours.absmax, state.absmax) and (
                not state.nested or torch.equal(ours.state2.absmax, state.state2.absmax))
            checked += 1
            identical += same_bytes and same_state
    for layer in layers:
        layer.reshard()
    quantized = {weight_key(f"{n}.weight") for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    plain = {weight_key(name): param.full_tensor() for name, param in model.named_parameters()
             if not param.requires_grad and weight_key(name) not in quantized}
    plain_identical = sum(torch.equal(t, originals[k].to(t.dtype)) for k, t in plain.items())
    return {"checked": checked, "identical": identical, "plain": len(plain), "plain_identical": plain_identical,
            "settings": settings}


# ---- the tests ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def samples(tiny_model_dir):
    return variable_length_samples(tiny_config(tiny_model_dir), 16)


@pytest.mark.old_torch  # run on torch 2.11 too (make test-old-torch)
def test_sharded_two_ranks_match_unsharded(tiny_model_dir, samples, tmp_path):
    """Loss, every LoRA gradient, the clipped global norm and the clipped update: 2 ranks against one unsharded
    model (a norm over the local shard only would be about 1/sqrt(2) of the real one and clip less)."""
    cfg = tiny_config(tiny_model_dir)
    per_rank = [batches(samples[:4], 4, PAD), batches(samples[4:8], 4, PAD)]
    sharded = run_ranks(clipped_update, 2, cfg, per_rank, tmp_dir=tmp_path)
    reference = run_ranks(clipped_update, 1, cfg, [per_rank[0] + per_rank[1]], False, tmp_dir=tmp_path)[0]
    assert sharded[0]["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    assert sharded[1]["loss"] == sharded[0]["loss"]
    assert reference["norm"] > 1e-2  # far above the 1e-3 clip: the update is scaled by the norm
    for rank in sharded:
        assert relative_difference(rank["grads"], reference["grads"]) <= 1e-5
        assert rank["norm"] == pytest.approx(reference["norm"], rel=1e-5)
        assert relative_difference(rank["delta"], reference["delta"]) <= 1e-5


@pytest.mark.old_torch  # run on torch 2.11 too (make test-old-torch)
def test_cpu_offload_matches_no_offload(tiny_model_dir, samples, tmp_path):
    """FSDP2's CPU-offload path (host shards and gradients, the 8-bit optimizer stepping host tensors, global
    clipping) runs on the CPU mesh and gives the numbers of the same 2 ranks without offload."""
    per_rank = [batches(samples[:8], 4, PAD), batches(samples[8:16], 4, PAD)]  # 2 micro-batches a rank
    calls = [(clipped_update, (tiny_config(tiny_model_dir, fsdp={"cpu_offload": offload}), per_rank, True, False))
             for offload in (True, False)]
    offloaded, plain = run_ranks_sequence(calls, 2, tmp_path)
    assert offloaded["offloaded"] > 0 and plain["offloaded"] == 0
    assert offloaded["optimizer"] is bnb.optim.AdamW8bit  # paged state has nothing to page on host shards
    assert offloaded["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert relative_difference(offloaded["grads"], plain["grads"]) <= 1e-6
    assert offloaded["norm"] == pytest.approx(plain["norm"], rel=1e-6)
    assert relative_difference(offloaded["delta"], plain["delta"]) <= 1e-6
    assert relative_difference(plain["delta"], {k: torch.zeros_like(v) for k, v in plain["delta"].items()}) > 0


def test_train_step_is_one_optimizer_update(tiny_model_dir, tmp_path):
    """Trainer.train_step with 3 micro-batches a rank equals one accumulated gradient, one clip and one optimizer
    step; the optimizer counts one step and no gradient is left for the next."""
    (tmp_path / "run").mkdir()  # the trainer's log goes there
    cfg = tiny_config(tiny_model_dir, data={"micro_batch_size": 2, "grad_accum_steps": 3},
                      train={"output_dir": str(tmp_path / "run")})
    for rank in run_ranks(trainer_step_and_reference, 2, cfg, tmp_dir=tmp_path):
        assert rank["micro_batches"] == 3
        assert rank["optimizer_steps"] == {1}
        assert rank["grads_left"] == 0
        assert relative_difference(rank["trainer"], rank["reference"]) <= 1e-6


# every dtype setting the config accepts, with bf16 base weights (the default, and the case where a layer's
# all-gather can be uniformly bf16)
DTYPE_COMBINATIONS = list(itertools.product(("float32", "bfloat16", "float16"), (None, "bfloat16"), (False, True)))


@pytest.mark.old_torch  # run on torch 2.11 too (make test-old-torch)
def test_packed_weights_survive_cuda_copy_behaviour(tiny_model_dir, samples, tmp_path):
    """Under the CUDA copy (bf16 NaN patterns canonicalized), 2 sharded ranks still equal one rank, for every
    accepted lora.dtype x fsdp.param_dtype x lora.use_dora; the reference is unsharded (world of one; with a bf16
    policy FSDP2 wraps it too, so both compute with the same casts). The old bf16 storage fails the same check."""
    def config(lora_dtype, param_dtype, dora):
        return tiny_config(tiny_model_dir, model={"dtype": "bfloat16"}, lora={"dtype": lora_dtype, "use_dora": dora},
                           fsdp={"param_dtype": param_dtype})

    per_rank = [batches(samples[:4], 4, PAD), batches(samples[4:8], 4, PAD)]
    configs = [config(*combination) for combination in DTYPE_COMBINATIONS]
    old_storage = config("bfloat16", None, False)
    sharded = run_ranks_sequence([(loss_and_grads_on_cuda_copies, (c, per_rank)) for c in configs]
                                 + [(loss_and_grads_on_cuda_copies, (old_storage, per_rank, torch.bfloat16))],
                                 2, tmp_path)
    references = run_ranks_sequence([(loss_and_grads, (c, [per_rank[0] + per_rank[1]])) for c in configs],
                                    1, tmp_path)
    for combination, ours, reference in zip(DTYPE_COMBINATIONS, sharded, references, strict=False):
        assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-6), combination
        assert relative_difference(ours["grads"], reference["grads"]) <= 1e-5, combination
    # the check can fail: bf16-stored packed weights in an all-bf16 layer decode wrong after the CUDA copy
    corrupted, reference = sharded[-1], references[DTYPE_COMBINATIONS.index(("bfloat16", None, False))]
    assert abs(corrupted["loss"] - reference["loss"]) > 1e-3 * reference["loss"]
    assert relative_difference(corrupted["grads"], reference["grads"]) > 0.1


def test_hsdp_two_replicas_of_two_shards_match_plain_fsdp(tiny_model_dir, samples, tmp_path):
    """HSDP (the multi-node layout): 4 ranks as 2 replicas x 2 shards give the loss, gradients, clipped norm and
    update of the same 4 ranks sharding one copy (which test_sharded_two_ranks_match_unsharded ties to one
    unsharded model)."""
    cfg = tiny_config(tiny_model_dir)
    per_rank = [batches(samples[4 * r : 4 * r + 4], 2, PAD) for r in range(4)]
    for hsdp, fsdp in run_ranks(hsdp_and_fsdp_steps, 4, cfg, per_rank, 2, tmp_dir=tmp_path):
        assert hsdp["mesh"] == (2, 2) and fsdp["mesh"] == (4,)
        name, shape = next(iter(hsdp["shard_shapes"].items()))
        assert shape[0] == 2 * fsdp["shard_shapes"][name][0]  # sharded over 2 ranks, not 4
        assert hsdp["loss"] == pytest.approx(fsdp["loss"], rel=1e-6)
        assert relative_difference(hsdp["grads"], fsdp["grads"]) <= 1e-5
        assert hsdp["norm"] == pytest.approx(fsdp["norm"], rel=1e-5)
        assert relative_difference(hsdp["delta"], fsdp["delta"]) <= 1e-5


@pytest.mark.parametrize("world_size", [1, 2])
def test_accumulation_equals_one_big_batch(tiny_model_dir, samples, tmp_path, world_size):
    cfg = tiny_config(tiny_model_dir)
    per_rank = [samples[r * 8 : (r + 1) * 8] for r in range(world_size)]
    accumulated = [batches(s, 2, PAD) for s in per_rank]  # 4 micro-batches of 2
    one_batch = [batches(s, 8, PAD) for s in per_rank]  # 1 batch of 8
    g_acc, g_big, naive, step_acc, step_big = run_ranks_sequence(
        [(loss_and_grads, (cfg, accumulated)), (loss_and_grads, (cfg, one_batch)),
         (naive_mean_of_means, (cfg, accumulated)), (sgd_update, (cfg, accumulated)), (sgd_update, (cfg, one_batch))],
        world_size, tmp_path)
    assert g_acc["loss"] == pytest.approx(g_big["loss"], rel=1e-5)
    assert relative_difference(g_acc["grads"], g_big["grads"]) <= 1e-4

    # the check can fail: a mean of per-micro-batch means weights short samples' tokens more
    assert relative_difference(naive["grads"], g_big["grads"]) > 1e-2

    assert relative_difference(step_acc["delta"], step_big["delta"]) <= 1e-4


@pytest.mark.old_torch  # run on torch 2.11 too (make test-old-torch)
def test_gradients_reduce_scattered_once_per_step(tiny_model_dir, samples, tmp_path):
    cfg = tiny_config(tiny_model_dir)
    per_rank = [batches(samples[:8], 2, PAD), batches(samples[8:16], 2, PAD)]  # 4 micro-batches a rank
    counts = run_ranks(count_reduce_scatters, 2, cfg, per_rank, tmp_dir=tmp_path)[0]
    assert counts["layer_groups"] == 2
    assert counts["accumulated"] == counts["layer_groups"]  # one per layer group, after the last micro-batch
    assert counts["every_micro_batch"] == 4 * counts["layer_groups"]


# (recipe keys, the same settings spelled out for bitsandbytes)
QUANT_SETTINGS = [({}, {"blocksize": 64, "quant_type": "nf4", "compress_statistics": True}),
                  ({"blocksize": 128, "quant_type": "fp4", "double_quant": False},
                   {"blocksize": 128, "quant_type": "fp4", "compress_statistics": False})]


def test_packed_4bit_weights_unshard_byte_identical(tiny_model_dir, tmp_path):
    calls = [(packed_weights_match, (tiny_config(tiny_model_dir, model={"dtype": "bfloat16"}, quant=keys), literal))
             for keys, literal in QUANT_SETTINGS]
    for rank in run_ranks_sequence(calls, 2, tmp_path, all_ranks=True):
        for result, (_, literal) in zip(rank, QUANT_SETTINGS, strict=True):
            assert result["settings"] == {(literal["blocksize"], literal["quant_type"], literal["compress_statistics"],
                                           torch.uint8)}
            assert result["checked"] == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
            assert result["identical"] == result["checked"]
            assert result["plain"] == 2 * 2 + 3  # 2 layers x 2 norms; embeddings, final norm, lm_head
            assert result["plain_identical"] == result["plain"]  # read as row ranges, gathered back whole
