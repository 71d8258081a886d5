"""CUDA paths of the observability tools (run by benchmarks/gpu_check.sh; skipped without a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.observe.peak_memory import PeakMemory
from moetrain.observe.profiler import ProfilerWindow

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_peaks_see_a_freed_allocation_and_reset():
    device = torch.device("cuda")
    meter = PeakMemory(device)
    size = 512 * 2**20
    block = torch.empty(size, dtype=torch.uint8, device=device)
    del block
    first = meter.read_and_reset()
    assert first["cuda_max_allocated"] >= size and first["cuda_max_reserved"] >= size
    second = meter.read_and_reset()
    assert second["cuda_max_allocated"] < size  # the new window no longer holds the freed block
    assert second["cuda_max_reserved"] >= second["cuda_max_allocated"]


def test_profiler_window_records_cuda_kernels(tmp_path):
    device = torch.device("cuda")
    window = ProfilerWindow((2, 2), tmp_path, rank=0, device=device)
    x = torch.randn(512, 512, device=device)
    for step in (1, 2, 3):
        with window.step(step):
            (x @ x).sum().item()
    events = json.loads((tmp_path / "rank0_steps2-2.json").read_text())["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events)  # GPU kernels, not only CPU ops
    assert sum(event.get("name") == "step 2" for event in events) >= 1
