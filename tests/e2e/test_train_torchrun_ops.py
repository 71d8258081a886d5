"""torchrun on CPU: a hung rank ends the job within parallel.collective_timeout_s; a signal to one rank stops all."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moetrain.checkpoint.layout import list_complete
from moetrain.runtime.faults import HANG_ENV
from moetrain.runtime.signals import EXIT_STOPPED_BY_SIGNAL

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
pytestmark = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH next to this interpreter")


def _launch(nproc: int, args: list[str], **env: str) -> subprocess.Popen:
    command = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "-m", "moetrain", "train", *args]
    # Own session, so a failed test can kill torchrun and every rank it started.
    return subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _communicate(proc: subprocess.Popen, timeout_s: float) -> str:
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout_s} s:\n{stderr[-3000:]}")
    return stderr


def _rank_pid(launcher_pid: int, rank: int, timeout_s: float = 60) -> int:
    """The pid of the worker torchrun started for `rank` (read from its environment)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
        for pid in children:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"torchrun started no rank {rank} within {timeout_s} s")


def test_a_hung_rank_ends_every_rank_within_the_collective_timeout(job_args, tmp_path):
    run_dir = tmp_path / "run"
    start = time.monotonic()
    # Rank 1 hangs before step 2; rank 0 waits in step 2's first collective.
    proc = _launch(2, job_args(run_dir, train__eval_every=0, parallel__collective_timeout_s=10), **{HANG_ENV: "1:2"})
    stderr = _communicate(proc, timeout_s=150)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    lines = [line for line in stderr.splitlines() if line.startswith("moetrain: error:")]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("moetrain: error: rank 0: a collective did not complete within "
                               "parallel.collective_timeout_s = 10 s during step 2"), lines[0]
    # The hung rank, asked to stop by torchrun, ends once the same timeout has passed.
    assert re.search(r"exitcode\s*:\s*3 ", stderr) and re.search(r"exitcode\s*:\s*143 ", stderr), stderr[-3000:]
    assert elapsed < 120  # not gloo's default of 30 minutes


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(job_args, read_train_records,
                                                                                    tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch(2, job_args(run_dir, train__steps=300, train__eval_every=0, checkpoint__every=1000))
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never logged a step"
            time.sleep(0.1)
        os.kill(_rank_pid(proc.pid, 1), signal.SIGTERM)  # rank 0 never gets a signal
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    stderr = _communicate(proc, timeout_s=120)
    stopped = json.loads(metrics.read_text().splitlines()[-1])
    assert stopped["kind"] == "stopped" and stopped["signal"] == "a signal to another rank", stderr[-3000:]
    step = stopped["step"]
    assert max(read_train_records(run_dir)) == step < 300
    assert [ref.step for ref in list_complete(run_dir / "checkpoints")] == [step]
    lines = [line for line in stderr.splitlines() if line.startswith("moetrain: stopped by")]
    assert lines == [f"moetrain: stopped by a signal to another rank after step {step} of 300; checkpoint "
                     f"step_{step:08d} saved; resume with --checkpoint.resume True"], stderr[-3000:]
    assert len(re.findall(rf"exitcode\s*:\s*{EXIT_STOPPED_BY_SIGNAL} ", stderr)) >= 1, stderr[-3000:]
