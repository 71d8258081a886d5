"""`moetrain bench moe` smoke test on a tiny override: JSON schema, saved bytes vs the closed form
(bytes only, never time), the granularity sweep outputs, and one-line errors for bad options."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from moetrain.bench import moe as bench_moe
from moetrain.cli import main as cli_main
from moetrain.errors import ConfigError

TINY = ["--tokens", "64", "--hidden", "32", "--intermediate", "8", "--n_experts", "8", "--top_k", "2",
        "--warmup", "0", "--repeats", "5"]


def test_bench_json_schema_and_saved_bytes_match_formula(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_moe.main(["--preset", "fine", *TINY, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["preset"] == "fine"
    assert report["config"]["tokens"] == 64 and report["config"]["n_experts"] == 8
    by_impl = {r["impl"]: r for r in report["results"]}
    assert set(by_impl) == {"loop", "grouped", "memory_efficient"}
    for r in report["results"]:
        assert isinstance(r["saved_bytes"], int) and r["saved_bytes"] > 0
        assert r["fwd_bwd_ms"] > 0
    mem = by_impl["memory_efficient"]
    assert abs(mem["saved_bytes"] - mem["formula_bytes"]) <= 0.05 * mem["formula_bytes"]
    # closed form recomputed here: X + H (2n wide) + scores (fp32) + token indices (int64) + counts (int64)
    tokens, hidden, inner, experts, top_k = 64, 32, 8, 8, 2
    assert mem["formula_bytes"] == (tokens * hidden * 4 + tokens * top_k * 2 * inner * 4 + tokens * top_k * 4
                                    + tokens * top_k * 8 + experts * 8)
    # the standard-autograd paths keep the gathered input and expert outputs: strictly more
    assert by_impl["grouped"]["saved_bytes"] > 2 * mem["saved_bytes"]
    assert {r["backend"] for r in report["backend_comparison"]} == {"segment_loop", "torch_grouped_mm"}
    assert "memory_efficient formula" in capsys.readouterr().out


def test_bench_sweep_writes_plot_and_keeps_memory_efficient_bytes_flat(tmp_path):
    args = ["--tokens", "16", "--hidden", "16", "--warmup", "0", "--repeats", "5", "--no-backend-comparison",
            "--sweep-bytes-only"]
    assert bench_moe.main([*args, "--sweep", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "bench_moe_granularity.png").stat().st_size > 0
    rows = json.loads((tmp_path / "bench_moe_granularity.json").read_text())["sweep"]
    assert [(r["n_experts"], r["top_k"], r["intermediate"]) for r in rows] == list(bench_moe.GRANULARITY_SWEEP)
    for r in rows:
        assert abs(r["memory_efficient_saved_bytes"] - r["formula_bytes"]) <= 0.05 * r["formula_bytes"]
    # the standard path grows with top_k (gathered X and Y are tokens*top_k x hidden)
    grouped = [r["grouped_saved_bytes"] for r in rows]
    assert grouped == sorted(grouped) and grouped[-1] > grouped[0]


def test_bench_bad_options_are_config_errors(capsys):
    with pytest.raises(ConfigError, match="--preset = 'huge' is invalid: valid presets are fine, coarse"):
        bench_moe.main(["--preset", "huge"])
    with pytest.raises(ConfigError, match="--repeats = 3 is invalid"):
        bench_moe.main([*TINY[:-2], "--repeats", "3"])
    with pytest.raises(ConfigError, match="Error parsing --tokens: .*'many'"):
        bench_moe.main(["--tokens", "many"])
    assert cli_main(["bench", "moe", "--top_k", "99"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--top_k = 99" in err[0]


def test_bench_reports_the_layer_against_the_same_dtype_gemm_peak(tmp_path):
    out = tmp_path / "bench.json"
    assert bench_moe.main([*TINY, "--no-backend-comparison", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    # closed form: forward 2 A d (2n) + 2 A n d for SwiGLU, backward twice that; A = tokens * top_k
    assignments, hidden, inner = 64 * 2, 32, 8
    assert report["layer_gemm_flops"] == 3 * (2 * assignments * hidden * 2 * inner + 2 * assignments * inner * hidden)
    assert report["gemm_peak_flops_per_s"] > 0
    for r in report["results"]:
        assert r["gemm_flops_per_s"] == pytest.approx(report["layer_gemm_flops"] / (r["fwd_bwd_ms"] / 1e3))
        assert r["fraction_of_gemm_peak"] == pytest.approx(r["gemm_flops_per_s"] / report["gemm_peak_flops_per_s"])


def test_qwen3_moe_debug_preset_is_one_layer_of_that_config():
    config = tomllib.loads((Path(__file__).parents[2] / "configs/qwen3_moe_debug.toml").read_text())
    model, moe = config["model"], config["model"]["moe"]
    opts = bench_moe.parse_options(["--preset", "qwen3_moe_debug"])
    assert (opts.hidden, opts.intermediate, opts.n_experts, opts.top_k, opts.activation) == (
        model["dim"], moe["expert_hidden"], moe["n_experts"], moe["top_k"], moe.get("activation", "swiglu"))
    assert opts.tokens == 2 * config["data"]["seq_len"]  # the microbatch: 2 x 512 tokens


def test_bench_cpu_clock_and_its_bad_values(tmp_path):
    out = tmp_path / "bench.json"
    assert bench_moe.main([*TINY, "--no-backend-comparison", "--clock", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["clock"] == "cpu" and report["gemm_peak_flops_per_s"] > 0
    with pytest.raises(ConfigError, match="--clock = 'sundial' is invalid: valid: wall, cpu"):
        bench_moe.main([*TINY, "--clock", "sundial"])
