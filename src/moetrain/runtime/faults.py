"""Fault hooks for tests: a rank that hangs, a write paused for a kill or failing, a crash after a step.

Each hook does nothing unless its environment variable names this rank and step, so a
user's run never meets one. Tests set the variables to reproduce a hung rank (collective
timeout), a SIGKILL in the middle of a checkpoint write, a checkpoint write that fails (an I/O
error once its tensor files are written), and a crash between steps that a torchrun restart must
recover from. This module only sleeps, raises or exits; it decides nothing.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

HANG_ENV = "MOETRAIN_TEST_HANG_AT_STEP"  # "<rank>:<step>": sleep forever before computing that step
PAUSE_ENV = "MOETRAIN_TEST_PAUSE_IN_CHECKPOINT_WRITE"  # "<step>": rank 0 sleeps inside that step's write
FAIL_ENV = "MOETRAIN_TEST_FAIL_IN_CHECKPOINT_WRITE"  # "<step>": every rank's write of that step fails
CRASH_STEP_ENV = "MOETRAIN_TEST_CRASH_AFTER_STEP"  # "<step>": rank 0 exits after that step ...
CRASH_MARKER_ENV = "MOETRAIN_TEST_CRASH_MARKER"  # ... once: unless this file exists, which it then creates
CRASH_EXIT_CODE = 17
PAUSE_STEPS_ENV = "MOETRAIN_TEST_PAUSE_STEPS_FILE"  # "<path>": a file holding <step>: wait before it and later steps


def hang_before_step(rank: int, step: int) -> None:
    if os.environ.get(HANG_ENV) == f"{rank}:{step}":
        while True:
            time.sleep(1)


def pause_before_step(step: int) -> None:
    """Hold every rank before `step` while the file named by PAUSE_STEPS_ENV holds a step <= `step`, so that
    a test can kill, and restart, a peer replica group at a chosen step (it rewrites or removes the file)."""
    path = os.environ.get(PAUSE_STEPS_ENV)
    while path:
        try:
            if step < int(Path(path).read_text()):
                return
        except (OSError, ValueError):  # removed (or being rewritten): a removed file holds nothing back
            if not os.path.exists(path):
                return
        time.sleep(0.05)


def pause_in_checkpoint_write(step: int, tmp: Path) -> None:
    """After the data files of `step`'s checkpoint are written and before the rename."""
    if os.environ.get(PAUSE_ENV) == str(step):
        (tmp / "PAUSED").write_text("paused inside the checkpoint write for a kill test\n")
        while True:  # until the test kills this process
            time.sleep(1)


def fail_in_checkpoint_write(step: int, tmp: Path) -> None:
    """After `step`'s tensor files are written into `tmp` and before they are hashed: an I/O error."""
    if os.environ.get(FAIL_ENV) == str(step):
        raise OSError(errno.EIO, f"test fault: the checkpoint write of step {step} failed", str(tmp))


def crash_after_step(step: int, rank: int) -> None:
    marker = os.environ.get(CRASH_MARKER_ENV)
    if os.environ.get(CRASH_STEP_ENV) != str(step) or not marker or rank != 0:
        return
    try:
        with open(marker, "x") as f:  # exclusive create: the crash happens once across restarts
            f.write(f"crashed after step {step}\n")
    except FileExistsError:
        return
    os._exit(CRASH_EXIT_CODE)
