"""The input sweep (benchmarks/stress/input_sweep.py) over the commands that do not train: no case ends in a traceback.

The whole sweep (train included, ~400 cases) is the benchmark script; here the commands whose cases
take milliseconds to a second each: sample, plot, export-hf, data prepare, simulate, init-report.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "stress" / "input_sweep.py"
FAST = ("sample", "plot", "export-hf", "data ", "simulate", "init-report", "unknown", "bench")


def test_no_input_of_the_fast_commands_ends_in_a_traceback(tmp_path):
    spec = importlib.util.spec_from_file_location("input_sweep", SCRIPT)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    fixtures = sweep.build_fixtures(tmp_path)
    log_dir = tmp_path / "stderr"
    log_dir.mkdir()
    results = [(name, sweep.run_case(argv, 60.0, log_dir, i))
               for i, (name, argv) in enumerate(sweep.cases(fixtures)) if name.startswith(FAST)]
    assert len(results) > 100
    failed = [(name, r["outcome"], r["answer"]) for name, r in results if not r["ok"]]
    assert not failed, failed
    refused = [r for _, r in results if r["code"] == 2]
    assert [r["answer"] for r in refused if not r["answer"].startswith("moetrain: error:")] == []
