"""Memory figures as a CUDA run reports them, with the CUDA calls faked: allocated beside reserved."""

from __future__ import annotations

import torch

from qlora_fsdp.training.metrics import format_progress, memory_peaks_gb, reset_memory_peaks

GIB = 2**30


def test_cuda_memory_peaks_report_reserved_beside_allocated(monkeypatch):
    peaks = {"allocated": 12 * GIB, "reserved": 15 * GIB}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: peaks["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: peaks["reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: peaks.update(allocated=0, reserved=0))
    cuda = torch.device("cuda", 0)
    assert memory_peaks_gb(cuda) == {"peak_memory_gb": 12.0, "peak_reserved_gb": 15.0}
    reset_memory_peaks(cuda)  # each step's record is that step's peak
    assert memory_peaks_gb(cuda) == {"peak_memory_gb": 0.0, "peak_reserved_gb": 0.0}
    assert format_progress({"loss": 1.5, "peak_memory_gb": 12.0}) == "loss=1.5000 mem=12.00G"

