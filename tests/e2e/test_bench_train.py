"""`moetrain bench train`: phases that add up to the step, a measured MFU peak that is positive and used.

Also the training records: with `train.peak_flops = 0` (the default) MFU is computed against the
peak measured on the spot, recorded beside it.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from moetrain.bench import train as bench_train
from moetrain.errors import ConfigError
from moetrain.observe import peak_flops as pf
from moetrain.observe.peak_flops import measure_gemm_flops
from moetrain.train import run


def test_bench_train_reports_phases_memory_and_mfu_against_a_measured_peak(job_args, tmp_path):
    out = tmp_path / "bench.json"
    assert bench_train.main(job_args(tmp_path / "run") + ["--steps", "3", "--warmup", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not (tmp_path / "run").exists()  # a benchmark writes no run directory
    assert result["world_size"] == 1 and result["steps"] == 3 and len(result["losses"]) == 3
    phases = result["phases_s_median"]
    assert set(phases) == {"data", "forward", "backward", "collectives", "wait", "optimizer"}
    assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0
    # Medians of parts need not add up exactly; they cannot exceed the step by much.
    assert sum(phases.values()) <= 1.5 * max(max(s) for s in result["step_s_per_rank"])
    assert result["peak_flops_source"] in ("cached", "measured idle", "busy estimate")
    assert result["peak_flops_per_rank"] > 0
    expected_mfu = result["flops_per_token"] * result["tokens_per_s"] / result["peak_flops_per_rank"]
    assert result["mfu"] == pytest.approx(expected_mfu, rel=1e-12)
    assert result["tokens_per_s"] == pytest.approx(result["tokens_per_step"] / result["step_s_median"])
    assert result["memory_per_rank"][0]["peak_rss_bytes"] > 0


def test_bench_train_rejects_a_bad_step_count(job_args, tmp_path):
    with pytest.raises(ConfigError, match="--steps"):
        bench_train.main(job_args(tmp_path / "run") + ["--steps", "0"])


def test_train_records_use_the_measured_peak(job_args, tmp_path):
    assert run.main(job_args(tmp_path / "run", train__steps=2, train__eval_every=0)) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train and all(r["peak_flops_per_rank"] > 0 for r in train)
    start = next(r for r in records if r.get("event") == "start")
    for r in train:
        assert r["mfu"] == pytest.approx(start["flops_per_token"] * r["tokens_per_s"] / r["peak_flops_per_rank"])


def test_a_configured_peak_overrides_the_measurement(job_args, tmp_path):
    assert run.main(job_args(tmp_path / "run", train__steps=1, train__eval_every=0, train__peak_flops=2e9)) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["peak_flops_per_rank"] for r in records if r["kind"] == "train"] == [2e9]


def test_gemm_peak_is_the_rate_of_a_timed_product():
    # A 2*n^3-FLOP product must take at least 2*n^3 / peak seconds, measured independently here.
    peak = measure_gemm_flops(torch.float32, "cpu", 1, size=256)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(4):
        torch.mm(a, b)
    assert 0 < peak and 4 * 2 * 256**3 / peak <= (time.perf_counter() - start) * 1.5


def test_a_training_log_divides_by_the_peak_of_the_threads_it_runs(job_args, tmp_path, monkeypatch):
    # Seeded cache: a 2-thread run must read the entry of the threads it can run at once, 2 wherever there
    # are 2 cores (the old probe used one thread's peak).
    peaks = {1: 11e9, 2: 23e9}
    monkeypatch.setenv(pf.CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "gemm_peaks.json").write_text(json.dumps(
        {pf.machine_key(torch.float32, threads): peak for threads, peak in peaks.items()}))
    args = job_args(tmp_path / "run", train__steps=1, train__eval_every=0, train__num_threads=2)
    assert run.main(args) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    expected = peaks[min(2, os.cpu_count() or 1)]
    assert [(r["peak_flops_per_rank"], r["peak_flops_source"]) for r in train] == [(expected, "cached")]
