"""Known GPUs: the device names CUDA reports map to the right table entry (memory, peak for MFU)."""

from __future__ import annotations

import pytest
import torch

from qlora_fsdp.run.accelerators import GPUS, detect_gpu, peak_flops

# torch.cuda.get_device_name as these cards report it -> the table's key
REPORTED = {
    "NVIDIA L4": "l4",
    "NVIDIA L40S": "l40s",
    "NVIDIA L40": "l40",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200",
    "NVIDIA GeForce RTX 4090": "rtx4090",
    "NVIDIA GeForce RTX 3090": "rtx3090",
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "NVIDIA A100 80GB PCIe": "a100-80gb-pcie",  # no NVLink: collectives cross PCIe
    "NVIDIA A100-PCIE-40GB": "a100-40gb-pcie",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA RTX 6000 Ada Generation": "rtx6000ada",
    "Quadro RTX 6000": None,  # Turing, not the Ada card
    "NVIDIA RTX A6000": "rtxa6000",  # Ampere, not the Ada card
    "NVIDIA RTX A5000": "rtxa5000",
    "NVIDIA GeForce RTX 5090": "rtx5090",
    "Tesla T4": "t4",  # Turing: no bf16, so `auto` trains in float16
    "Tesla V100-SXM2-16GB": "v100-16gb",
    "Tesla V100-PCIE-16GB": "v100-16gb",
    "Tesla V100-SXM2-32GB": None,  # another memory size: not the 16 GB entry
}


@pytest.mark.parametrize(("name", "key"), REPORTED.items())
def test_reported_device_names_map_to_their_own_entry(monkeypatch, name, key):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert detect_gpu(torch.device("cuda", 0)) == key
    assert key is None or key in GPUS


def test_mfu_peaks_follow_the_variant_not_the_family(monkeypatch):
    peaks = {}
    for name in ("NVIDIA L4", "NVIDIA L40", "NVIDIA L40S", "NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        peaks[name] = peak_flops(torch.device("cuda", 0)) / 1e12
    assert peaks == {"NVIDIA L4": 121.0, "NVIDIA L40": 181.0, "NVIDIA L40S": 362.0, "NVIDIA H100 PCIe": 756.0,
                     "NVIDIA H100 80GB HBM3": 989.0}


def test_cpu_has_no_gpu_entry():
    assert detect_gpu(torch.device("cpu")) is None and peak_flops(torch.device("cpu")) is None
