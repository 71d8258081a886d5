"""One process and multi-rank meshes from the same seed and global batch train the same model.

With the world-size-independent data order, 1 process × grad_accum 4, FSDP over 4 ranks and
expert parallelism over 4 ranks (one expert group per rank) read the same global batch each
step; float32 losses and gradient norms agree to summation-order noise for the first 5 steps.
A difference in data order, token weighting, gradient reduction or expert dispatch shows up
here as a loss drift of 1e-3 or more.
"""

from __future__ import annotations

import pytest
from test_train_torchrun import TORCHRUN, _torchrun

from moetrain.train import run

STEPS = [1, 2, 3, 4, 5]
JOB = {"train__steps": 5, "train__microbatch_size": 2, "train__eval_every": 0, "checkpoint__enabled": False}


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH next to this interpreter")
def test_one_process_fsdp_and_expert_parallel_runs_give_the_same_losses(job_args, read_train_records, tmp_path):
    one = tmp_path / "one"
    assert run.main(job_args(one, train__grad_accum=4, **JOB)) == 0
    expected = read_train_records(one)
    assert sorted(expected) == STEPS
    for name, extra in (("fsdp4", {}), ("ep4", {"parallel__ep": 4})):
        done = _torchrun(4, job_args(tmp_path / name, train__grad_accum=1, **JOB, **extra))
        assert done.returncode == 0, done.stderr[-3000:]
        got = read_train_records(tmp_path / name)
        assert sorted(got) == STEPS, name
        for step in STEPS:
            assert got[step]["valid_tokens"] == expected[step]["valid_tokens"], (name, step)
            assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), (name, step)
            assert got[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=1e-4), (name, step)
    # The runs learn: a constant loss would make the comparison vacuous.
    assert expected[5]["loss"] < expected[1]["loss"]
