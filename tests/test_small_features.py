"""Issue 16's small features: rsLoRA, optim.warmup_ratio, a readable run summary, output_dir shared by nodes."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import peft
import pytest
import torch
import yaml
from peft import PeftModel
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from qlora_fsdp.config import Config, OptimConfig, changed_settings, load_config, to_yaml
from qlora_fsdp.data.templates import prompt_ids
from qlora_fsdp.distributed import DistInfo
from qlora_fsdp.errors import ConfigError, ModelLoadError
from qlora_fsdp.model.adapter import check_scaling, config_for_adapter, load_adapter_into, read_adapter
from qlora_fsdp.model.build import build_meta_model, load_hf_config
from qlora_fsdp.model.factory import build_model
from qlora_fsdp.tools.merge import as_trained, merge_adapter
from qlora_fsdp.training.loop import RunSummary
from qlora_fsdp.training.metrics import format_duration, format_rate, format_summary
from qlora_fsdp.training.optimizer import ShardedOptimizer, build_scheduler, lr_factor, warmup_steps
from qlora_fsdp.training.shared_dir import MARKER_PREFIX, check_shared_folder, spans_several_nodes
from tests.helpers import run_ranks, tiny_config
from tests.test_merge_generate import PROMPT, adapter_and_logits

# build_model(shard=False) never reads the mesh, so this one process needs no process group
ONE_PROCESS = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), mesh=None)  # type: ignore[arg-type]


# ---- rsLoRA ----

def lora_scalings(model: nn.Module) -> set[float]:
    return {module.scaling["default"] for module in model.modules() if isinstance(module, peft.tuners.lora.LoraLayer)}


@pytest.mark.parametrize(("use_rslora", "expected"), [(True, 32 / math.sqrt(16)), (False, 32 / 16)])
def test_lora_layers_scale_by_alpha_over_sqrt_r_with_rslora(tiny_model_dir, use_rslora, expected):
    cfg = tiny_config(tiny_model_dir, lora={"r": 16, "alpha": 32, "use_rslora": use_rslora})
    assert lora_scalings(build_meta_model(cfg, load_hf_config(cfg))) == {expected}


def peft_on_dequantized_base(cfg: Config, adapter: Path) -> PeftModel:
    """Plain transformers + PEFT on the unquantized checkpoint, each 4-bit weight replaced by what training computed
    with (quantized and dequantized as the loader does), so the outputs must match the 4-bit model's."""
    base = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in cfg.quant.skip_modules:
                module.weight.copy_(as_trained(module.weight, cfg))
    return PeftModel.from_pretrained(base, adapter).eval()


@pytest.fixture(scope="module")
def rslora_adapter(tiny_model_dir, tmp_path_factory):
    """(config, exported rsLoRA adapter far from its init, input ids, the 4-bit model's logits with and without it)."""
    cfg = tiny_config(tiny_model_dir, lora={"r": 16, "alpha": 32, "use_rslora": True})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    input_ids = torch.tensor([prompt_ids([{"role": "user", "content": PROMPT}], tokenizer, "alpaca")])
    adapter = tmp_path_factory.mktemp("rslora") / "adapter"
    ours, base = adapter_and_logits(ONE_PROCESS, cfg, adapter, input_ids)
    assert (ours - base).abs().max() > 0.1  # the adapter matters, so matching it means something
    return cfg, adapter, input_ids, ours


def test_exported_rslora_adapter_loads_in_peft_with_the_same_outputs(rslora_adapter):
    cfg, adapter, input_ids, ours = rslora_adapter
    assert json.loads((adapter / "adapter_config.json").read_text())["use_rslora"] is True
    model = peft_on_dequantized_base(cfg, adapter)
    assert lora_scalings(model) == {32 / math.sqrt(16)}
    with torch.no_grad():
        theirs = model(input_ids=input_ids).logits
    assert (theirs - ours).abs().max() < 1e-4 * ours.abs().max()


def test_merged_rslora_adapter_gives_the_live_logits(rslora_adapter, tmp_path):
    _, adapter, input_ids, ours = rslora_adapter
    merge_adapter(config_for_adapter(adapter, None, []), adapter, tmp_path / "merged", "float32")
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(input_ids).logits
    assert (merged - ours).abs().max() < 1e-4 * ours.abs().max()


def test_generation_rebuilds_the_rslora_model_from_the_adapter(rslora_adapter):
    """generate.py builds from the adapter's training_config.yaml and loads the weights into it: same logits."""
    _, adapter, input_ids, ours = rslora_adapter
    saved = config_for_adapter(adapter, None, [])
    assert saved.lora.use_rslora
    model = build_model(saved, ONE_PROCESS, shard=False)
    load_adapter_into(model, adapter)
    with torch.no_grad():
        assert (model(input_ids=input_ids).logits - ours).abs().max() < 1e-5 * ours.abs().max()


def test_adapter_with_other_scaling_is_refused(rslora_adapter):
    """Weights of the right shapes with the wrong scaling would load silently and compute another model."""
    trained, adapter, _, _ = rslora_adapter
    cfg = copy.deepcopy(trained)
    cfg.lora.use_rslora = False
    saved, _ = read_adapter(adapter)
    with pytest.raises(ModelLoadError, match="trained with lora.use_rslora=True, the recipe says False"):
        check_scaling(saved, build_meta_model(cfg, load_hf_config(cfg)), adapter)


# ---- optim.warmup_ratio ----

def scheduler_lrs(optim: OptimConfig, total_steps: int) -> list[float]:
    """The learning rate of each optimizer step, from the scheduler training builds."""
    optimizer = ShardedOptimizer([nn.Parameter(torch.zeros(4))], optim)
    scheduler = build_scheduler(optimizer, optim, total_steps)
    lrs = []
    for _ in range(total_steps):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("scheduler", ["cosine", "linear", "constant"])
def test_warmup_ratio_is_the_same_schedule_as_its_warmup_steps(scheduler):
    by_ratio = OptimConfig(name="adamw", lr=1e-3, scheduler=scheduler, warmup_ratio=0.1)
    by_steps = OptimConfig(name="adamw", lr=1e-3, scheduler=scheduler, warmup_steps=3)
    lrs = scheduler_lrs(by_ratio, 30)  # 0.1 x 30 steps: 3 warmup steps (3.0000000000000004 in floats)
    assert lrs == scheduler_lrs(by_steps, 30)
    assert lrs[2] == pytest.approx(0.75e-3) and lrs[3] == pytest.approx(1e-3)  # last warmup step, first after


def test_warmup_ratio_rounds_up_to_whole_steps():
    assert [warmup_steps(OptimConfig(warmup_ratio=r), 30) for r in (0.0, 0.05, 0.1, 0.5)] == [0, 2, 3, 15]
    assert warmup_steps(OptimConfig(warmup_steps=7), 30) == 7
    assert lr_factor(1, OptimConfig(warmup_ratio=0.05), 30) == pytest.approx(2 / 3)


@pytest.mark.parametrize(("overrides", "message"), [
    (["optim.warmup_ratio=0.1"], "'optim.warmup_steps: 10' and 'optim.warmup_ratio: 0.1' are both set"),
    (["optim.warmup_steps=0", "optim.warmup_ratio=1"], "'optim.warmup_ratio' must be at least 0 and below 1"),
    (["optim.warmup_steps=0", "optim.warmup_ratio=-0.1"], "'optim.warmup_ratio' must be at least 0 and below 1"),
])
def test_bad_warmup_settings_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:  # tiny_cpu sets warmup_steps: 10
        load_config("tiny_cpu", overrides)
    assert "\n" not in str(err.value)
    assert load_config("tiny_cpu", ["optim.warmup_steps=0", "optim.warmup_ratio=0.05"]).optim.warmup_ratio == 0.05


# ---- the run summary ----

def test_summary_prints_counts_as_integers_and_times_rounded():
    summary = RunSummary(train_runtime_s=192.4, steps=150, skipped_steps=0, samples=5204, tokens=1_234_567,
                         mfu=0.0123, eval_loss_start=2.345678, eval_loss_end=1.234561,
                         memory_peaks_gb={"peak_memory_gb": 1.5}, adapter="outputs/demo/adapter")
    lines = format_summary(summary.as_dict()).split("\n")
    assert lines[:2] == ["", "summary".center(len("peak_memory_gb_max_rank") + 16, "-")]
    shown = dict(line.split(" : ") for line in lines[2:])
    assert {key.strip(): value for key, value in shown.items()} == {
        "train_runtime_s": "3 min 12 s", "steps": "150", "skipped_steps": "0", "samples": "5,204",
        "samples_per_s": "27.0", "tokens": "1,234,567", "tokens_per_s": "6,417", "mfu": "1.23%",
        "eval_loss_start": "2.3457", "eval_loss_end": "1.2346", "eval_ppl_end": "3.44",
        "peak_memory_gb_max_rank": "1.50 GiB", "adapter": "outputs/demo/adapter"}


def test_durations_and_rates():
    assert [format_duration(s) for s in (0.04, 41.27, 59.96, 192.4, 3599.6, 3720, 90_000)] == [
        "0.0 s", "41.3 s", "1 min 00 s", "3 min 12 s", "1 h 00 min", "1 h 02 min", "25 h 00 min"]
    assert [format_rate(r) for r in (0.0, 0.012345, 3.2149, 45.61, 1234.4)] == ["0", "0.0123", "3.21", "45.6",
                                                                                "1,234"]
    assert format_summary({"eval_loss_end": math.nan, "stopped_by_signal": True}).split("\n")[2:] == [
        "eval_loss_end     : nan", "stopped_by_signal : True"]


# ---- train.output_dir on storage every node sees ----

def shared_folder_outcomes(info, shared: Path, node_local: Path) -> tuple[list[str], list[str]]:
    """Rank 1 stands for another node's first process: it looks in the shared folder, then in one of its own."""
    outcomes = []
    for rank_1_folder in (shared, node_local):
        try:
            check_shared_folder(shared if info.rank == 0 else rank_1_folder, info, checks=info.rank == 1, wait_s=0.5)
            outcomes.append("ok")
        except ConfigError as err:
            outcomes.append(str(err))
    return outcomes, sorted(path.name for path in shared.iterdir())


@pytest.mark.slow
def test_output_dir_not_shared_by_nodes_fails_on_every_rank(tmp_path):
    shared, node_local = tmp_path / "shared", tmp_path / "node_local"
    node_local.mkdir()
    ranks = run_ranks(shared_folder_outcomes, 2, shared, node_local, tmp_dir=tmp_path / "ranks")
    assert ranks[0][1] == []  # rank 0 removed its marker before returning (rank 1 may have looked before that)
    for rank, ((same_folder, other_folder), _) in enumerate(ranks):
        assert same_folder == "ok"
        folder = shared if rank == 0 else node_local
        assert other_folder == (f"train.output_dir {folder} is not on storage shared by all nodes: rank 1 cannot see "
                                "a file rank 0 wrote there, and rank 0 alone writes checkpoints and the adapter; use "
                                "a shared filesystem (NFS, Lustre, ...) mounted at the same path on every node")
    assert not list(node_local.glob(f"{MARKER_PREFIX}*"))


def test_several_nodes_are_told_by_torchruns_local_world_size(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert not spans_several_nodes(4)  # not under torchrun: run_ranks' worlds, a plain python run
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert spans_several_nodes(16) and not spans_several_nodes(8)


def test_resuming_a_checkpoint_from_before_the_new_keys_names_no_change():
    """A checkpoint's config.yaml written before lora.use_rslora and optim.warmup_ratio existed ran with their
    defaults: resuming it reports no change, but does report one where the resumed run sets them."""
    old = Config()
    saved = yaml.safe_load(to_yaml(old))
    del saved["lora"]["use_rslora"], saved["optim"]["warmup_ratio"]
    assert changed_settings(yaml.safe_dump(saved), old) == []
    now = copy.deepcopy(old)
    now.optim.warmup_ratio, now.lora.use_rslora = 0.1, True
    assert changed_settings(yaml.safe_dump(saved), now) == ["lora.use_rslora: False -> True",
                                                            "optim.warmup_ratio: 0.0 -> 0.1"]
