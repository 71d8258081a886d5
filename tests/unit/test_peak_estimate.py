"""`moetrain estimate`'s peak: activations against what autograd really saves, the measured process and data
terms, FSDP buffers, and `train --dry-run` refusing in one line when the peak exceeds the target device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_memory_estimate import saved_for_backward_bytes

from moetrain import cli
from moetrain.config.job import parse_job_args
from moetrain.model.memory_estimate import HEAP_SLACK, estimate_peak
from moetrain.model.transformer import Transformer
from moetrain.observe.peak_memory import current_rss_bytes
from moetrain.train import job_estimate

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config", str(ROOT / "configs" / "tiny_moe.toml"), "--data.seq_len", "128", "--train.microbatch_size", "2"]
QWEN3 = ["--config", str(ROOT / "configs" / "qwen3_moe_debug.toml"), "--data.seq_len", "128", "--model.n_layers", "2"]


@pytest.mark.parametrize("argv", [
    TINY, [*TINY, "--model.qk_norm", "none"], [*TINY, "--model.moe.impl", "grouped"],
    [*TINY, "--model.n_dense_layers", "0", "--model.n_kv_heads", "2"], [*TINY, "--model.moe.n_shared_experts", "1"],
    QWEN3,
], ids=["tiny", "no-qk-norm", "grouped", "gqa-all-moe", "shared-expert", "qwen3-debug"])
def test_saved_activations_are_within_ten_percent_of_what_autograd_keeps(argv):
    cfg = parse_job_args(argv)
    peak = estimate_peak(cfg)
    # The loss keeps one float32 copy of the logits; the other two in `logits` are the backward's.
    estimated = peak.activations + peak.logits // 3
    measured = saved_for_backward_bytes(cfg)
    assert abs(estimated / measured - 1) < 0.10, (estimated, measured)


def test_sharding_splits_the_state_and_adds_the_fsdp_buffers():
    cfg = parse_job_args(TINY)
    one, two = estimate_peak(cfg, 1), estimate_peak(cfg, 2)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Transformer(cfg.model).parameters())
    assert one.weights == 4 * n_params and abs(two.weights - 2 * n_params) <= 4
    assert one.optimizer == 2 * one.weights and one.fsdp_buffers == 0 < two.fsdp_buffers
    assert two.activations == one.activations  # each rank runs its own microbatch
    # On CPU the heap's slack is a fixed fraction of the step's transients; a GPU's memory has none of it.
    transients = one.activations + one.backward_working + one.logits
    assert estimate_peak(cfg, 1, host_heap=True).allocator == int(HEAP_SLACK * transients) > 0
    assert one.allocator == 0


def test_process_and_data_are_measured_here(monkeypatch):
    cfg = parse_job_args(TINY)
    before = current_rss_bytes()
    est = job_estimate.estimate(cfg, 1, 1, "cpu")
    assert 0.9 * before <= est.peak.process <= current_rss_bytes() * 1.1
    assert est.peak.peak == est.peak.step_peak > est.lower_bound
    on_gpu = job_estimate.estimate(cfg, 1, 1, "H100")
    assert on_gpu.peak.process == on_gpu.peak.data == on_gpu.peak.allocator == 0  # host memory, not the device's


def test_the_data_term_is_what_loading_the_data_adds_to_a_fresh_process():
    # In a fresh process, as `moetrain estimate` runs: in this long-lived test process earlier tests' freed
    # heap can take the corpus's tokens without the resident set growing.
    proc = subprocess.run([sys.executable, "-m", "moetrain", "estimate", *TINY, "--json"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, check=True)
    parts = json.loads(proc.stdout)["parts"]
    assert parts["data"] > 0  # the corpus's tokens, held while measured


def test_estimate_json_has_the_parts_that_add_up_to_the_peak(capsys):
    assert cli.main(["estimate", *TINY, "--device", "L4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["peak_bytes"] == sum(v for k, v in report["parts"].items() if k != "optimizer_temporaries")
    assert report["fits"] is True and report["available_bytes"] == 24 * 2**30
    assert cli.main(["estimate", *TINY, "--json", "--skip-data"]) == 0
    on_cpu = json.loads(capsys.readouterr().out)
    assert on_cpu["parts"]["data"] == 0 < on_cpu["parts"]["process"]


def test_dry_run_refuses_in_one_line_when_the_peak_exceeds_the_named_gpu(tmp_path, capsys):
    run_dir = tmp_path / "run"
    job = [*TINY, "--logging.run_dir", str(run_dir), "--data.max_documents", "50"]
    assert cli.main(["train", *job, "--dry-run", "--device", "L4"]) == 0
    assert "fits on L4" in capsys.readouterr().out
    assert cli.main(["train", *job, "--dry-run", "--device", "L4", "--device-memory", "0.05"]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "estimated peak is" in lines[0] and "more than L4 with 51.2 MiB" in lines[0], lines
    assert "does NOT fit on L4" in captured.out  # the report is printed before the refusal
    assert not run_dir.exists()  # a dry run writes nothing


@pytest.mark.parametrize("extra,needle", [
    (["--device", "cuda"], "no CUDA device is visible"),
    (["--device", "L4", "--device-memory", "-1"], "--device-memory = '-1' is invalid"),
    (["--device", "TPUv9"], "--device = 'TPUv9' is invalid"),
])
def test_bad_targets_are_one_line(extra, needle, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["estimate", *TINY, *extra]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], lines
