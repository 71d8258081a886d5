"""Profiler labels without expert parallelism: one profiled step of a one-process run carries every MoE stage.

Expert parallelism's own ranges (its dispatch, combine and the all-to-alls) are checked on two ranks in
tests/distributed/test_profiler_ranks.py; here the same stage names must appear when no token leaves the rank.
"""

from __future__ import annotations

import json

import pytest

from moetrain import cli

LABELS = {"attention", "router", "dispatch", "experts", "combine", "optimizer"}


@pytest.mark.parametrize("impl", ["memory_efficient", "grouped"])
def test_one_profiled_step_carries_every_stage_label(job_args, tmp_path, impl):
    run_dir = tmp_path / "run"
    argv = job_args(run_dir, train__steps=2, checkpoint__enabled=False, train__eval_every=0,
                    profile__steps="2-2", model__moe__impl=impl, model__moe__n_shared_experts=1)
    assert cli.main(["train", *argv]) == 0
    events = json.loads((run_dir / "profile" / "rank0_steps2-2.json").read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert LABELS <= names, LABELS - names
    # Each stage label is a range around real work: some aten op starts inside its time span.
    ops = [e for e in events if e.get("name", "").startswith("aten::") and "ts" in e]
    for label in LABELS:
        spans = [e for e in events if e.get("name") == label and "dur" in e]
        assert any(s["ts"] <= op["ts"] <= s["ts"] + s["dur"] for s in spans for op in ops), label
