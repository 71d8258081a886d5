"""Exact resume: 2N steps in one go vs N steps, stop, resume, N more — losses identical step by step."""

from __future__ import annotations

import json

from moetrain.checkpoint.layout import list_complete
from moetrain.train import run


def test_stop_and_resume_reproduces_an_uninterrupted_run_bitwise(job_args, read_train_records, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run.main(job_args(straight)) == 0
    assert run.main(job_args(split, train__stop_at_step=3)) == 0
    assert [r.step for r in list_complete(split / "checkpoints")] == [3]
    assert run.main(job_args(split, checkpoint__resume=True)) == 0

    expected, resumed = read_train_records(straight), read_train_records(split)
    assert sorted(expected) == sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in expected:
        for key in ("loss", "grad_norm", "lr", "aux_loss", "valid_tokens"):
            assert resumed[step][key] == expected[step][key], (step, key)
    # The losses change from step to step (the equality is not one of constants), and the
    # held-out evaluation after the resume matches too.
    assert len({expected[step]["loss"] for step in expected}) == 6
    records = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
               for run in (straight, split)]
    final = [[r for r in recs if r["kind"] == "final"][-1] for recs in records]
    assert final[0]["heldout_loss"] == final[1]["heldout_loss"]
    assert final[0]["heldout_bpb"] > 0 and final[0]["unigram_entropy_bits"] > 0
