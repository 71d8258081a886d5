"""Elastic restarts: under `torchrun --max-restarts 1` a crashed 2-rank job restarts, resumes by itself
(`checkpoint.resume = "auto"`) from its newest checkpoint and logs the losses of an uninterrupted run.

Also the resume checks across world sizes: a 2-rank checkpoint resumed by one process with another
seed or other data is refused in one line, exactly as a same-size resume is.
"""

from __future__ import annotations

import json

import pytest
from test_train_torchrun import TORCHRUN, _torchrun

from moetrain import cli
from moetrain.runtime.faults import CRASH_EXIT_CODE, CRASH_MARKER_ENV, CRASH_STEP_ENV


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH next to this interpreter")
def test_a_crashed_job_restarts_and_matches_an_uninterrupted_one(job_args, read_train_records, tmp_path, capsys):
    settings = {"train__steps": 6, "checkpoint__every": 2, "train__eval_every": 0, "checkpoint__resume": "auto"}
    plain_dir, crashed_dir = tmp_path / "plain", tmp_path / "crashed"
    plain = _torchrun(2, job_args(plain_dir, **settings), timeout_s=240)
    assert plain.returncode == 0, plain.stderr[-3000:]
    marker = tmp_path / "crashed-once"
    crashed = _torchrun(2, job_args(crashed_dir, **settings),
                        {CRASH_STEP_ENV: "3", CRASH_MARKER_ENV: str(marker)}, max_restarts=1, timeout_s=240)
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert marker.exists() and f"exitcode: {CRASH_EXIT_CODE}" in crashed.stderr  # it did crash once
    events = [(r["event"], r["step"]) for r in map(json.loads, (crashed_dir / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "event"]
    assert events == [("start", 0), ("resume", 2)], events  # one crash, one restart, a clean end
    expected, got = read_train_records(plain_dir), read_train_records(crashed_dir)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4, 5, 6]
    for step in expected:  # bit-identical: same data order, RNG and optimizer state after the restart
        assert (got[step]["loss"], got[step]["grad_norm"]) == (expected[step]["loss"], expected[step]["grad_norm"])
    final = [json.loads(line) for line in (crashed_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["kind"] == "final" and final["step"] == 6

    # The 2-rank checkpoint resumed by one process: the seed and data checks still apply.
    capsys.readouterr()
    for field, value in [("train.seed", 3), ("data.heldout_fraction", 0.3)]:
        args = job_args(crashed_dir, **{**settings, "train__steps": 8, field.replace(".", "__"): value})
        assert cli.main(["train", *args]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"moetrain: error: {field} = {value} differs from"), lines
