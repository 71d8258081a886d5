"""Exact resume on any world size, and token-budget batching in the trainer.

A 4-rank run checkpointed at step 2 and resumed on 2 ranks (grad_accum 2) and on 1
(grad_accum 4), the same global batch, continues with the uninterrupted 4-rank run's
batches: equal valid-token counts, and losses within float32 summation-order noise.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_train_torchrun import TORCHRUN, _torchrun

from moetrain.train import run

LATER_STEPS = [3, 4, 5]


def _short_documents(corpus_dir, path, n_lines: int) -> dict[str, object]:
    """Overrides for a JSONL corpus of 1 to 4 source lines per document (the first n_lines lines of two modules).

    Short documents make the valid-token count of a packed batch vary with its content, and
    let several documents share a token budget.
    """
    lines = [line for name in ("bisect.py", "colorsys.py") for line in (corpus_dir / name).read_text().splitlines()]
    with path.open("w") as out:
        start, size = 0, 1
        while start < min(n_lines, len(lines)):
            out.write(json.dumps({"text": "\n".join(lines[start: start + size])}) + "\n")
            start, size = start + size, size % 4 + 1
    return {"data__source": "jsonl", "data__path": path}


def _resume_copy(source, target) -> None:
    """A run directory holding only `source`'s step-2 checkpoint."""
    (target / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "step_00000002", target / "checkpoints" / "step_00000002")


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH next to this interpreter")
def test_4_rank_checkpoint_resumes_exactly_on_2_and_on_1_rank(job_args, corpus_dir, read_train_records, tmp_path):
    # A corpus of 25 sequences of 32 tokens (not a multiple of 4): steps 3-5 read global
    # units 16-39, across the end of the first epoch, where a per-rank split of each epoch would
    # differ between 4, 2 and 1 ranks.
    job = {"train__steps": 5, "train__microbatch_size": 2, "checkpoint__every": 2, "train__eval_every": 0,
           **_short_documents(corpus_dir, tmp_path / "short.jsonl", n_lines=36)}
    four = tmp_path / "four"
    done = _torchrun(4, job_args(four, train__grad_accum=1, **job))
    assert done.returncode == 0, done.stderr[-3000:]
    expected = read_train_records(four)
    assert sorted(expected) == [1, 2, 3, 4, 5]
    start = json.loads((four / "metrics.jsonl").read_text().splitlines()[0])
    assert 16 < start["train_sequences"] < 40 and start["train_sequences"] % 4, start["train_sequences"]

    two, one = tmp_path / "two", tmp_path / "one"
    for target in (two, one):
        _resume_copy(four, target)
    resumed = _torchrun(2, job_args(two, train__grad_accum=2, checkpoint__resume=True, **job))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint was written by 4 ranks, resuming on 2: same global data order" in resumed.stderr
    assert run.main(job_args(one, train__grad_accum=4, checkpoint__resume=True, **job)) == 0

    for world, run_dir in ((2, two), (1, one)):
        got = read_train_records(run_dir)
        assert sorted(got) == LATER_STEPS, world
        for step in LATER_STEPS:
            # The same sequences: the valid-token count of a global batch is exact.
            assert got[step]["valid_tokens"] == expected[step]["valid_tokens"], (world, step)
            assert got[step]["tokens_seen"] == expected[step]["tokens_seen"], (world, step)
            assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), (world, step)
            assert got[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=1e-4), (world, step)
    # The valid-token counts differ from step to step, so their equality pins the batches.
    assert len({expected[step]["valid_tokens"] for step in LATER_STEPS}) > 1


def test_token_budget_run_resumes_bitwise_with_varying_microbatches(job_args, corpus_dir, read_train_records,
                                                                     tmp_path):
    budget = {"data__batching": "token_budget", "data__token_budget": 64, "model__max_seq_len": 64,
              **_short_documents(corpus_dir, tmp_path / "short.jsonl", n_lines=10**6)}
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run.main(job_args(straight, **budget)) == 0
    assert run.main(job_args(split, train__stop_at_step=3, **budget)) == 0
    assert run.main(job_args(split, checkpoint__resume=True, **budget)) == 0
    expected, resumed = read_train_records(straight), read_train_records(split)
    assert sorted(expected) == sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in expected:
        for key in ("loss", "grad_norm", "valid_tokens", "tokens_seen"):
            assert resumed[step][key] == expected[step][key], (step, key)
    # Steps hold different numbers of tokens (2 microbatches of at most 64 tokens each).
    inputs = [expected[s]["tokens_seen"] - expected.get(s - 1, {"tokens_seen": 0})["tokens_seen"] for s in expected]
    assert len(set(inputs)) > 1 and max(inputs) <= 2 * 64
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if r["kind"] == "final"][-1]["heldout_bpb"] > 0
