"""`moetrain bench sync` end to end on 4 spawned gloo ranks (tiny sleep model): output schema only, never timings."""

import json

import numpy as np
import pytest

from moetrain.bench.costs import CostSpec, draw_costs
from moetrain.bench.sync import main
from moetrain.bench.sync_options import MODE_SETUP
from moetrain.errors import ConfigError


def test_smoke_four_ranks_writes_schema_and_chart(tmp_path, capsys):
    out, png = tmp_path / "sync.json", tmp_path / "sync.png"
    argv = ["--steps", "2", "--warmup-steps", "0", "--accum", "2", "--layers", "2", "--cost.short", "0.005",
            "--bootstrap", "20", "--seed", "7", "--json", str(out), "--figure", str(png), "--timeout-s", "150"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [row["mode"] for row in result["modes"]] == list(MODE_SETUP)
    for row in result["modes"]:
        for key in ("median_step_s", "p90_step_s", "samples_per_s", "collective_wait_s", "ratio_mean_to_ref",
                    "predicted_median_step_s"):
            assert isinstance(row[key], float) and np.isfinite(row[key]), key
        assert len(row["ratio_mean_ci95"]) == 2 and len(row["step_s"]) == 2
    assert set(result["predicted"]) == set(MODE_SETUP)
    assert all(isinstance(v, float) and v > 0 for v in result["predicted"].values())
    # The run used exactly the shared draws: same spec and seed give the same [steps, accum, groups] costs.
    expected = draw_costs(CostSpec("bimodal", 0.005, 4.0, 0.5), seed=7, steps=2, accum=2, groups=2)
    np.testing.assert_array_equal(np.asarray(result["costs"]), expected)
    assert np.asarray(result["costs_s"]).shape == (2, 2, 2)
    assert result["environment"]["world_size"] == 4
    assert result["calibration"]["comm"]["points"], "alpha-beta microbenchmark points are recorded"
    assert png.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "isolates synchronisation" in printed and "hsdp-delayed" in printed
    # The summary over runs quotes the run's own measured and predicted ratios.
    summary_png = tmp_path / "summary.png"
    assert main(["--summarize", str(out), "--figure", str(summary_png)]) == 0
    table = capsys.readouterr().out
    hsdp = next(row for row in result["modes"] if row["mode"] == "hsdp")
    assert f"| hsdp | {hsdp['ratio_mean_to_ref']:.3f}" in table
    assert summary_png.stat().st_size > 0
    with pytest.raises(ConfigError, match="does not exist"):
        main(["--summarize", str(tmp_path / "missing.json")])


def test_pipeline_variant_runs_torchs_schedule_on_two_pipelines(tmp_path, capsys):
    # PP 2 x 2 replica groups: each replica group one 1F1B pipeline; the simulator predicts the same modes.
    out = tmp_path / "sync_pp.json"
    argv = ["--pp", "2", "--replicate", "2", "--shard", "1", "--steps", "1", "--warmup-steps", "0", "--accum", "2",
            "--layers", "2", "--cost.short", "0.002", "--bootstrap", "10", "--json", str(out), "--figure", "none",
            "--modes", "hsdp", "hsdp-delayed", "hsdp-final-only", "--timeout-s", "150"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [row["mode"] for row in result["modes"]] == ["hsdp", "hsdp-delayed", "hsdp-final-only"]
    assert result["environment"]["world_size"] == 4
    for row in result["modes"]:
        assert row["predicted_mean_step_s"] > 0 and np.isfinite(row["ratio_mean_to_ref"])
    # Every microbatch's compute was recorded by the stages: [steps, accum, replica groups], all positive.
    assert (np.asarray(result["measured_compute_s"]) > 0).all()
    assert "pipelines of pp 2 (1F1B)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["--replicate", "0"], "replicate"),
    (["--modes", "hsdp", "fsdp"], "hsdp-delayed"),
    (["--modes", "ddp"], "modes"),
    (["--cost.p-long", "2"], "p_long"),
    (["--cost-model", "varlen"], "cost"),
    (["--accum", "two"], "accum"),
    (["--pp", "2", "--cost-model", "batch"], "fixed-shape"),
    (["--pp", "2", "--pp-schedule", "ZBVZeroBubble", "--pp-stages-per-rank", "2"], "pp_schedule"),
    (["--pp", "2", "--layers", "3"], "layers"),
    (["--pp", "0"], "pp"),
])
def test_bad_options_fail_with_one_line_before_spawning(argv, match):
    with pytest.raises(ConfigError, match=match) as err:
        main(argv)
    assert "\n" not in str(err.value)
