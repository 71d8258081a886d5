"""Observability against direct computations: expert health, the expert-load figure, peak memory, the console line."""

from __future__ import annotations

import json
import mmap

import numpy as np
import pytest
import torch

from moetrain.observe.metrics import console_line, expert_health
from moetrain.observe.peak_memory import PeakMemory, current_rss_bytes
from moetrain.observe.plot import expert_load_figure
from moetrain.observe.profiler import ProfilerWindow


def _loads() -> np.ndarray:
    rng = np.random.default_rng(0)
    load = rng.integers(0, 50, size=(3, 16)).astype(np.float64)
    load[1, [2, 5, 11]] = 0  # three idle experts in layer 1
    load[2] = 7  # perfectly even layer: CV 0
    return load


def test_expert_health_matches_numpy():
    load = _loads()
    bias = np.random.default_rng(1).normal(size=(3, 16))
    health = expert_health(torch.tensor(load, dtype=torch.float32), torch.tensor(bias, dtype=torch.float32))
    assert health["expert_load_min_per_layer"] == load.min(axis=1).astype(int).tolist()
    assert health["expert_load_max_per_layer"] == load.max(axis=1).astype(int).tolist()
    cv = load.std(axis=1) / load.mean(axis=1)  # numpy's std is the population std (ddof=0)
    np.testing.assert_allclose(health["expert_load_cv_per_layer"], cv, rtol=1e-12)
    assert health["expert_load_cv_per_layer"][2] == 0.0
    assert health["experts_without_tokens_per_layer"] == [int((row == 0).sum()) for row in load]
    assert health["experts_without_tokens_per_layer"][1] >= 3
    assert health["experts_without_tokens"] == int((load == 0).sum())
    np.testing.assert_allclose(health["expert_bias_range_per_layer"],
                               bias.astype(np.float32).max(axis=1) - bias.astype(np.float32).min(axis=1), rtol=1e-6)
    assert "expert_bias_range_per_layer" not in expert_health(torch.tensor(load))


def test_expert_health_extremes_closed_form():
    one_expert_takes_all = torch.zeros(1, 8)
    one_expert_takes_all[0, 3] = 100
    health = expert_health(one_expert_takes_all)
    assert health["expert_load_cv_per_layer"][0] == pytest.approx(7 ** 0.5)  # sqrt(E - 1)
    assert health["experts_without_tokens_per_layer"] == [7]
    assert expert_health(torch.zeros(1, 8))["expert_load_cv_per_layer"] == [0.0]  # no tokens: no NaN


def test_expert_load_figure_draws_the_records_values():
    steps = [5, 10, 15]
    loads = [_loads() * (1 + i) + i for i in range(3)]
    records = [{"kind": "event", "step": 0}]
    for step, load in zip(steps, loads):
        health = expert_health(torch.tensor(load))
        health["expert_load_max_over_mean_per_layer"] = (load.max(axis=1) / load.mean(axis=1)).tolist()
        records.append({"kind": "train", "step": step, **health})
    fig = expert_load_figure(records, "t")
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert set(axes) == {"busiest expert over the mean", "expert load CV (std / mean)", "experts without a token"}
    cv_lines = axes["expert load CV (std / mean)"].get_lines()
    assert len(cv_lines) == 3  # one per MoE layer
    for layer, line in enumerate(cv_lines):
        assert list(line.get_xdata()) == steps
        want = [load[layer].std() / load[layer].mean() for load in loads]
        np.testing.assert_allclose(line.get_ydata(), want, rtol=1e-12)
    idle = axes["experts without a token"].get_lines()[1].get_ydata()
    assert list(idle) == [int((load[1] == 0).sum()) for load in loads]
    assert expert_load_figure([{"kind": "train", "step": 1, "loss": 1.0}], "t") is None  # dense model: none


def test_peak_memory_window_sees_a_freed_allocation_and_resets():
    meter = PeakMemory(torch.device("cpu"))
    meter.read_and_reset()
    before = current_rss_bytes()
    size = 256 * 2**20
    # An anonymous mapping of its own, not the heap: the trainer may have told malloc to keep
    # freed memory (moetrain.runtime.allocator), which would keep a freed heap block resident.
    block = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1  # written, so resident
    block.close()
    first = meter.read_and_reset()
    assert first["peak_rss"] >= before + 0.9 * size  # the freed block is in this window's peak
    assert first["rss"] < first["peak_rss"]
    if not meter.window_peaks:
        pytest.skip("this kernel cannot reset the RSS high-water mark: lifetime peaks only")
    second = meter.read_and_reset()
    assert second["peak_rss"] < first["peak_rss"] - 0.5 * size  # a new window no longer holds it
    assert set(first) == {"peak_rss", "rss"}  # no CUDA fields on a CPU device


def test_console_line_shows_the_largest_peak_over_ranks():
    record = {"step": 3, "loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0, "step_s": 1.0,
              "compute_s_per_rank": [0.9, 0.8], "wait_s_per_rank": [0.1, 0.2], "mfu": 0.01,
              "peak_rss_bytes_per_rank": [3 * 2**30, int(1.5 * 2**30)]}
    assert console_line(record, 10).endswith("| peak RSS 3.00G")
    record.update(cuda_max_allocated_bytes_per_rank=[2**30, 2 * 2**30], cuda_max_reserved_bytes_per_rank=[5 * 2**29])
    assert console_line(record, 10).endswith("| CUDA max alloc 2.00G reserved 2.50G")


def test_profiler_window_ending_early_still_writes_what_it_traced(tmp_path):
    window = ProfilerWindow((2, 5), tmp_path, rank=3, device=torch.device("cpu"))
    x = torch.randn(64, 64)
    for step in (1, 2, 3):  # the run stops at step 3, inside the window
        with window.step(step):
            x @ x
    assert not (tmp_path / "rank3_steps2-5.json").exists()
    window.close()
    window.close()  # idempotent
    names = {event.get("name") for event in json.loads((tmp_path / "rank3_steps2-5.json").read_text())["traceEvents"]}
    assert {"step 2", "step 3"} <= names and "step 1" not in names
