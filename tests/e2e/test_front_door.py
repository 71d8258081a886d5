"""What a user types after a run, answered in one line: a changed train.steps after a finished run (as
`make train ARGS="--train.steps 50"` passes it, with --checkpoint.resume auto)."""

from __future__ import annotations

from moetrain import cli


def test_fewer_steps_after_a_finished_run_says_nothing_is_trained(job_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["train", *job_args(run_dir, train__steps=3, checkpoint__every=3, train__eval_every=0)]) == 0
    metrics = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    again = job_args(run_dir, train__steps=2, checkpoint__every=3, train__eval_every=0, train__warmup_steps=1)
    assert cli.main(["train", *again, "--checkpoint.resume", "auto"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "train.steps = 2 trains nothing" in err[0] and "reached step 3" in err[0], err
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # the finished run's record is left as it was
