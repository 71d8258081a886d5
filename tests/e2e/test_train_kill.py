"""Kill test: SIGKILL inside a checkpoint write; the resumed run starts from the previous complete checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from moetrain.runtime.faults import PAUSE_ENV
from moetrain.train import run
from moetrain.train.checkpoint import list_complete


def test_sigkill_during_checkpoint_write_resumes_from_previous_complete_one(job_args, read_train_records, tmp_path):
    run_dir = tmp_path / "run"
    args = job_args(run_dir, checkpoint__every=2, train__eval_every=0)
    env = {**os.environ, PAUSE_ENV: "4"}  # rank 0 stops inside the write of step 4's checkpoint
    proc = subprocess.Popen([sys.executable, "-m", "moetrain", "train", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    paused = run_dir / "checkpoints" / ".tmp-step_00000004" / "PAUSED"
    try:
        deadline = time.monotonic() + 120
        while not paused.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the run never reached the paused checkpoint write"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
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
