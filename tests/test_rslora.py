"""rsLoRA (lora.use_rslora): the layers' scaling, and the exported adapter in PEFT, merge and generation."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import peft
import pytest
import torch
from peft import PeftModel
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from qlora_fsdp.config import Config
from qlora_fsdp.data.templates import prompt_ids
from qlora_fsdp.distributed import DistInfo
from qlora_fsdp.errors import ModelLoadError
from qlora_fsdp.loading.adapter import check_scaling, config_for_adapter, load_adapter_into, read_adapter
from qlora_fsdp.loading.build import build_meta_model
from qlora_fsdp.loading.checkpoint import load_hf_config
from qlora_fsdp.loading.factory import build_sharded_model
from qlora_fsdp.loading.nf4 import as_trained
from qlora_fsdp.tools.adapter_merge import merge_adapter
from tests.helpers import tiny_config
from tests.test_merge_generate import PROMPT, adapter_and_logits

# build_sharded_model(shard=False) never reads the mesh, so this one process needs no process group
ONE_PROCESS = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), mesh=None)  # type: ignore[arg-type]


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
                module.weight.copy_(as_trained(module.weight, cfg.quant))
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
    model = build_sharded_model(saved, ONE_PROCESS, shard=False)
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
