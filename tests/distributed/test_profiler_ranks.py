"""The profiler window under several ranks: each rank writes its own Chrome trace of the same steps."""

from __future__ import annotations

import json

from test_memory_flat import corpus, job_argv, train  # noqa: F401 - corpus is a fixture

from moetrain.testing import run_on_ranks


def test_every_rank_writes_its_trace_of_the_window(corpus, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    argv = job_argv(corpus, run_dir) + ["--train.steps", "3", "--profile.steps", "2-2", "--parallel.ep", "2"]
    run_on_ranks(train, 2, argv, timeout=120)
    traces = sorted(p.name for p in (run_dir / "profile").iterdir())
    assert traces == ["rank0_steps2-2.json", "rank1_steps2-2.json"]
    for name in traces:
        names = {event.get("name") for event in json.loads((run_dir / "profile" / name).read_text())["traceEvents"]}
        assert "step 2" in names and "step 1" not in names and "step 3" not in names
        # moetrain's ranges, expert parallelism's too (ep = 2)
        assert {"attention", "router", "experts", "dispatch", "combine", "all_to_all", "optimizer"} <= names, names
