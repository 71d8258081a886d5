"""One writer per run directory, foreign outputs kept, graceful signals: one process, real CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from moetrain import cli
from moetrain.checkpoint.layout import list_complete
from moetrain.runtime.faults import HANG_ENV
from moetrain.runtime.signals import EXIT_STOPPED_BY_SIGNAL


@contextmanager
def _started(args: list[str], **env: str) -> Iterator[subprocess.Popen]:
    """A `moetrain train` child that is killed and reaped on leaving, whatever the test asserted."""
    proc = subprocess.Popen([sys.executable, "-m", "moetrain", "train", *args], env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout_s: float = 120) -> None:
    """Until the run's metrics hold a train record of `step` (or fail when the run ends first)."""
    deadline = time.monotonic() + timeout_s
    metrics = run_dir / "metrics.jsonl"
    while True:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline, f"the run never reached step {step}"
        if metrics.exists():
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
            if any(r["kind"] == "train" and r["step"] >= step for r in records):
                return
        time.sleep(0.1)


def _finish(proc: subprocess.Popen, timeout_s: float = 60) -> str:
    return proc.communicate(timeout=timeout_s)[1]


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _moetrain_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("moetrain:")]


def test_a_second_writer_is_refused_and_a_killed_writer_never_blocks_the_resume(job_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = job_args(run_dir, train__eval_every=0, checkpoint__every=1)
    with _started(args, **{HANG_ENV: "0:3"}) as first:  # holds the run directory, hung before step 3
        _wait_for_step(first, run_dir, 2)
        while not list_complete(run_dir / "checkpoints") or list_complete(run_dir / "checkpoints")[-1].step < 2:
            time.sleep(0.1)
        before = _snapshot(run_dir)
        capsys.readouterr()
        for extra in ({}, {"checkpoint__resume": True}):
            assert cli.main(["train", *job_args(run_dir, train__eval_every=0, **extra)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "is in use by another training run" in err, err
            assert "logging.run_dir" in err
        assert _snapshot(run_dir) == before  # the refused runs wrote, replaced and deleted nothing
        first.send_signal(signal.SIGKILL)
        _finish(first)
    # The kernel dropped the killed run's lock: its resume is not blocked.
    assert cli.main(["train", *job_args(run_dir, train__eval_every=0, checkpoint__every=1,
                                        checkpoint__resume=True)]) == 0
    assert list_complete(run_dir / "checkpoints")[-1].step == 6


def test_a_fresh_run_keeps_the_config_and_metrics_another_run_left(job_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    # Checkpoints off: nothing protected these files before (only checkpoints were).
    assert cli.main(["train", *job_args(run_dir, train__steps=2, train__eval_every=0, checkpoint__enabled=False)]) == 0
    before = _snapshot(run_dir)
    assert {"config.json", "metrics.jsonl"} <= set(before)
    capsys.readouterr()
    assert cli.main(["train", *job_args(run_dir, train__steps=3, train__eval_every=0)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json and metrics.jsonl of another run" in err, err
    assert _snapshot(run_dir) == before
    # Asking to continue that run ("auto": resume if a checkpoint exists) claims its files: it restarts in place.
    assert cli.main(["train", *job_args(run_dir, train__steps=3, train__eval_every=0,
                                        checkpoint__resume="auto")]) == 0
    assert json.loads((run_dir / "config.json").read_text())["train"]["steps"] == 3


@pytest.mark.parametrize("save_after_s, saves", [(0, True), (3600, False)])
def test_sigterm_stops_at_a_step_boundary_saving_when_the_last_save_is_old(job_args, read_train_records, tmp_path,
                                                                          save_after_s, saves):
    run_dir = tmp_path / "run"
    args = job_args(run_dir, train__steps=200, train__eval_every=0, checkpoint__every=100,
                    checkpoint__signal_save_after_s=save_after_s)
    with _started(args) as proc:
        _wait_for_step(proc, run_dir, 2)
        proc.send_signal(signal.SIGTERM)
        stderr = _finish(proc)
    assert proc.returncode == EXIT_STOPPED_BY_SIGNAL, stderr[-2000:]
    stopped = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    step = stopped["step"]
    assert stopped["kind"] == "stopped" and stopped["signal"] == "SIGTERM" and 2 <= step < 100
    assert max(read_train_records(run_dir)) == step  # stopped at the boundary after the last full step
    lines = _moetrain_lines(stderr)
    assert len(lines) == 2 and "SIGTERM received" in lines[0], stderr[-2000:]
    assert lines[1].startswith(f"moetrain: stopped by SIGTERM after step {step} of 200;")
    complete = [ref.step for ref in list_complete(run_dir / "checkpoints")]
    assert complete == ([step] if saves else [])
    assert ("saved" in lines[1]) == saves


def test_a_second_signal_exits_at_once_and_a_hung_rank_ends_after_the_grace(job_args, tmp_path):
    run_dir = tmp_path / "run"
    # Hung before step 2: the first SIGTERM cannot reach a step boundary; the second ends it.
    args = job_args(run_dir, train__eval_every=0, parallel__collective_timeout_s=600)
    with _started(args, **{HANG_ENV: "0:2"}) as proc:
        _wait_for_step(proc, run_dir, 1)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.5)  # later than the same-event window
        assert proc.poll() is None  # the first signal only asked for a stop
        proc.send_signal(signal.SIGTERM)
        stderr = _finish(proc, timeout_s=30)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "second signal (SIGTERM): exiting now" in _moetrain_lines(stderr)[-1]

    # One signal to a hung rank: it ends by itself once parallel.collective_timeout_s has passed.
    hung_dir = tmp_path / "hung"
    args = job_args(hung_dir, train__eval_every=0, parallel__collective_timeout_s=2)
    with _started(args, **{HANG_ENV: "0:2"}) as proc:
        _wait_for_step(proc, hung_dir, 1)
        proc.send_signal(signal.SIGTERM)
        stderr = _finish(proc, timeout_s=30)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "no step boundary within 2 s of SIGTERM" in _moetrain_lines(stderr)[-1]
