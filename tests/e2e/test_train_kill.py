"""Kill test: SIGKILL inside a checkpoint write; the resumed run starts from the previous complete checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from moetrain.checkpoint.layout import list_complete
from moetrain.runtime.faults import PAUSE_ENV
from moetrain.train import run


def train_paused_at_step_4_then_sigkill(args: list[str], ready: Callable[[], bool], waiting_for: str) -> int:
    """Run `moetrain train ARGS` with rank 0's write of step 4's checkpoint paused (PAUSE_ENV), SIGKILL it
    once `ready()` holds (within 120 s, failing with its stderr if it ends first), and return its exit code."""
    env = {**os.environ, PAUSE_ENV: "4"}
    proc = subprocess.Popen([sys.executable, "-m", "moetrain", "train", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, f"the run never reached {waiting_for}"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    return proc.returncode


def test_sigkill_during_checkpoint_write_resumes_from_previous_complete_one(job_args, read_train_records, tmp_path):
    run_dir = tmp_path / "run"
    args = job_args(run_dir, checkpoint__every=2, train__eval_every=0)
    paused = run_dir / "checkpoints" / ".tmp-step_00000004" / "PAUSED"
    # rank 0 stops inside the write of step 4's checkpoint
    returncode = train_paused_at_step_4_then_sigkill(args, paused.exists, "the paused checkpoint write")
    assert returncode == -signal.SIGKILL
    # The interrupted write left only its temporary directory; step 2 is the newest complete one.
    assert [r.step for r in list_complete(run_dir / "checkpoints")] == [2]
    assert paused.parent.exists()
    killed = read_train_records(run_dir)
    assert sorted(killed) == [1, 2, 3, 4]

    assert run.main(job_args(run_dir, checkpoint__every=2, train__eval_every=0,
                            checkpoint__resume=True)) == 0
    assert not paused.parent.exists()  # the partial write was cleaned up, never read
    assert [r.step for r in list_complete(run_dir / "checkpoints")] == [2, 4, 6]
    resumed = read_train_records(run_dir)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    # Steps 3 and 4 were recomputed from the step-2 checkpoint: same losses as before the kill.
    for step in (3, 4):
        assert resumed[step]["loss"] == killed[step]["loss"] and resumed[step]["grad_norm"] == killed[step]["grad_norm"]
