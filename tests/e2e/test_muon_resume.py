"""`--train.optimizer muon` with QK-clip through the CLI: stop and resume reproduces an uninterrupted run bitwise.

The Muon momentum (and the AdamW moments beside it) go through DCP like AdamW's state did; a resumed run
that lost or mangled them would diverge from the straight run at the first step after the resume.
QK-clip with a small τ clips on every step, so the clipped weights go through the checkpoint too, and
each train record logs the maximum logit per layer and head.
"""

from __future__ import annotations

from moetrain.checkpoint.layout import list_complete
from moetrain.train import run

MUON = {"train__optimizer": "muon", "train__qk_clip_tau": 2.0, "model__qk_norm": "none"}


def test_muon_run_resumes_bitwise(job_args, read_train_records, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run.main(job_args(straight, **MUON)) == 0
    assert run.main(job_args(split, train__stop_at_step=3, **MUON)) == 0
    assert [r.step for r in list_complete(split / "checkpoints")] == [3]
    assert run.main(job_args(split, checkpoint__resume=True, **MUON)) == 0
    expected, resumed = read_train_records(straight), read_train_records(split)
    assert sorted(expected) == sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in expected:
        for key in ("loss", "grad_norm", "attention_max_logit"):
            assert resumed[step][key] == expected[step][key], (step, key)
    assert len({expected[step]["loss"] for step in expected}) == 6
    logits = expected[1]["attention_max_logit"]
    assert len(logits) == 2 and len(logits[0]) == 2  # [layer][head] of the tiny job
    assert max(max(row) for row in expected[6]["attention_max_logit"]) > 0
