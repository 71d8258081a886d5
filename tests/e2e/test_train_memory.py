"""Jobs that cannot fit in memory are refused from the config alone: one line with the estimate, exit 2,
nothing allocated, nothing written, in well under a second of work."""

from __future__ import annotations

import time

import pytest

from moetrain import cli
from moetrain.runtime import preflight

CASES = {
    # 4 x 524288^2 booleans: the document mask alone is 1 TiB.
    "mask": ({"data__seq_len": 524288, "model__max_seq_len": 524288, "train__microbatch_size": 4},
             "attention mask 1.0 TiB", "lower data.seq_len"),
    # 2M sequences of 32 tokens in one microbatch.
    "microbatch": ({"train__microbatch_size": 2_000_000}, "activations", "lower train.microbatch_size"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_job_larger_than_the_machine_is_refused_before_anything_is_written(job_args, tmp_path, capsys, monkeypatch,
                                                                          case):
    overrides, part, advice = CASES[case]
    # The machine is said to have 64 GiB whatever it has, so the test means the same everywhere.
    monkeypatch.setattr(preflight, "physical_memory_bytes", lambda: 64 * 2**30)
    run_dir = tmp_path / "run"
    start = time.perf_counter()
    assert cli.main(["train", *job_args(run_dir, **overrides)]) == 2
    elapsed = time.perf_counter() - start
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moetrain: error: this job needs an estimated "), lines
    assert part in lines[0] and advice in lines[0] and "more than the 64.0 GiB of this machine" in lines[0], lines
    assert not run_dir.exists()
    assert elapsed < 10, elapsed  # nothing was allocated or trained (main ran the job for minutes)
