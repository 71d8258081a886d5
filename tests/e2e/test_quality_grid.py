"""benchmarks/quality/grid.py --quick: the quality grid runs from a clone and writes its outputs.

Checks the shape of what the grid writes (a summary per row and seed, the table, the figures), that
stream_gap.py reads it (its span means against the summary's own loss curves), and that a second
invocation resumes instead of re-running finished runs; never the quality numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "quality" / "grid.py"
STREAM_GAP = ROOT / "benchmarks" / "quality" / "stream_gap.py"
ROWS = ["moe_default", "dense_active"]


def _grid(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--rows", *ROWS, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_quick_grid_writes_summary_table_and_figures_and_resumes(tmp_path):
    out = tmp_path / "quality"
    done = _grid(out)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [row["name"] for row in summary["rows"]] == ROWS
    assert summary["method"]["quick"] and summary["method"]["seeds"] == [0, 1]
    for row in summary["rows"]:
        assert sorted(row["seeds"]) == ["0", "1"], row["name"]
        assert row["params_total"] >= row["params_active"] > 0 and row["flops_per_token"] > 0
        assert row["heldout_bpb_spread"] >= 0
        for run in row["seeds"].values():
            assert run["heldout_bpb"] > 0
            assert [step for step, _ in run["eval_curve"]] == [3, 6]
            assert [step for step, _ in run["loss_curve"]][-1] == 6
            # Expert health over training exists for the MoE rows only.
            assert ("load_cv_curve" in run) == (row["name"] != "dense_active")
    dense = summary["rows"][1]
    assert dense["params_total"] == dense["params_active"] + 259 * 256 - 256  # the embedding rows a token skips
    for seed in ("0", "1"):
        assert sorted(summary["ranking_per_seed"][seed]) == sorted(ROWS)
    table = (out / "table.md").read_text().splitlines()
    assert len([line for line in table if line.startswith("| ") and "---" not in line]) == 1 + len(ROWS)
    for name in ("curves.png", "bpb_vs_flops.png", "expert_load.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    # The training-stream comparison reads that summary: per seed, the mean paired loss gap of each span.
    gap = subprocess.run([sys.executable, str(STREAM_GAP), str(out / "summary.json"), "--windows", "2",
                          "--out", str(out / "stream_gap.md"), "--plot", str(out / "stream_gap.png")],
                         capture_output=True, text=True, timeout=120)
    assert gap.returncode == 0, gap.stderr[-3000:]
    assert (out / "stream_gap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {line.split(" | ")[0]: line for line in (out / "stream_gap.md").read_text().splitlines()}
    assert rows["| training-stream gap, steps"] == "| training-stream gap, steps | 1-3 | 4-6 |"
    for seed in ("0", "1"):
        curves = [dict(r["seeds"][seed]["loss_curve"]) for r in summary["rows"]]
        late = [curves[1][step] - curves[0][step] for step in curves[0] if step >= 4]
        printed = float(rows[f"| seed {seed}, nats/token"].split(" | ")[-1].rstrip(" |"))
        assert abs(printed - sum(late) / len(late)) <= 5e-5, seed

    # Resume: finished runs are skipped, their records untouched.
    metrics = out / "runs" / "moe_default_s0" / "metrics.jsonl"
    before = metrics.read_bytes()
    again = _grid(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already done") == 2 * len(ROWS)
    assert metrics.read_bytes() == before


def test_unknown_row_is_refused(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path), "--rows", "no_such_row"],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "unknown rows ['no_such_row']" in done.stderr


def test_a_refused_row_is_not_run_and_is_reported_as_refused(tmp_path):
    # top-1 with renormalized gates is refused by config validation: the grid must not start it
    # (the run would exit 2) and must still build its report, naming the refusal.
    out = tmp_path / "quality"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--rows", "gran_8x1x256_renorm"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gran_8x1x256_renorm: not run (config validation refuses model.moe.top_k = 1" in done.stdout
    assert not any((out / "runs").iterdir())
    (row,) = json.loads((out / "summary.json").read_text())["rows"]
    assert row["seeds"] == {} and "model.moe.renormalize = True" in row["refused"]
    assert row["params_total"] > row["params_active"] > 0
    assert "| refused |" in (out / "table.md").read_text()
