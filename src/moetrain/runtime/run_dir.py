"""The layout of a run directory and the config a run stored there.

RUN_DIR/config.json (the run's resolved JobConfig), metrics.jsonl (records, see
`moetrain.observe.metrics`), checkpoints/step_XXXXXXXX/ (see `moetrain.train.checkpoint`),
logs/rank{R}.log (optional per-rank logs), profile/rank{R}_steps{A}-{B}.json (torch.profiler
traces, `profile.steps`) and training_curve.png (`moetrain plot`).
Every reader and writer of a run directory takes its paths from here. This module
names paths, reads the stored config and holds the run's writer lock; it writes no
run output (config, metrics, checkpoints are the run's and the checkpointer's).

One writer per run directory: a training run holds `RUN_DIR/run.lock` with an
exclusive `fcntl.flock` for its whole lifetime (`WriterLock`). Only rank 0 takes it,
because rank 0 is the rank that writes the config, the metrics and renames
checkpoints, and because every rank of one job locking the same file would lock
each other out (flock locks belong to open files, not to jobs); rank 0 broadcasts
the outcome so every rank of a second job stops. The kernel drops a flock when its
process exits however it exits (SIGKILL, OOM, power loss of the holder's node), so
a crashed run never leaves a lock that blocks its resume. The file itself stays: a
lock file that is deleted while another process waits on it would let two writers
hold locks on two different files.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from moetrain.config import JobConfig, from_dict
from moetrain.errors import ConfigError
from moetrain.parallel.collectives import broadcast_int, rank_and_world

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
LOCK_FILE = "run.lock"


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def curve(self) -> Path:
        return self.root / "training_curve.png"

    @property
    def profile(self) -> Path:
        return self.root / "profile"

    def load_config(self) -> JobConfig:
        """The JobConfig a training run saved here (one-line ConfigError when missing or bad)."""
        if not self.config.is_file():
            raise ConfigError(f"--run {str(self.root)!r} has no {CONFIG_FILE}; pass the logging.run_dir of a "
                              "training run")
        try:
            return from_dict(json.loads(self.config.read_text())).validate()
        except json.JSONDecodeError as err:
            raise ConfigError(f"{self.config} is not valid JSON: {err}") from None


class WriterLock:
    """The exclusive writer lock of a run directory, held by rank 0 from `acquire` to `release`.

    `acquire` is collective (every rank calls it): rank 0 tries the lock without waiting
    and broadcasts whether it got it; on every rank a lock held by another process is a
    one-line ConfigError naming the holder. A directory the lock had to create, still
    empty but for the lock file at `release` (the run stopped before writing anything),
    is removed again so a refused run leaves nothing behind.
    """

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self._fd: int | None = None
        self._created_dir = False
        self._entries_before: set[str] = set()
        self._config_before: bytes | None = None
        self._undone = False

    def acquire(self) -> None:
        refusal = ""
        if rank_and_world()[0] == 0:
            try:
                refusal = self._try_lock()
            except OSError as err:
                refusal = f"cannot create its lock file {str(self.run_dir.lock)!r}: {err.strerror}"
        if broadcast_int(1 if refusal else 0) == 0:
            return
        where = f"logging.run_dir = {str(self.run_dir.root)!r}"
        raise ConfigError(f"{where} {refusal}" if refusal else f"{where} could not be locked by rank 0 (see its error)")

    def _try_lock(self) -> str:
        """Take the lock; '' on success, else why not. The file stays empty: a refused run writes nothing."""
        root = self.run_dir.root
        self._created_dir = not root.exists()
        root.mkdir(parents=True, exist_ok=True)
        self._entries_before = {p.name for p in root.iterdir()}  # before the lock: a new lock file goes too
        while True:
            fd = os.open(self.run_dir.lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return (f"is in use by another training run (it holds {LOCK_FILE}); wait for it to end or choose "
                        "another --logging.run_dir")
            # The holder before us may have removed the file (its run wrote nothing) after we
            # opened it: a lock on an unlinked file guards nothing, so take the new file's.
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.run_dir.lock).st_ino
            except FileNotFoundError:
                same_file = False
            if same_file:
                break
            os.close(fd)
        self._fd = fd
        self._config_before = self.run_dir.config.read_bytes() if self.run_dir.config.is_file() else None
        return ""

    def undo_start(self) -> None:
        """Put the directory back as `acquire` found it, after a start refused before its first step (rank 0):
        what appeared since (config.json, metrics.jsonl, logs/, ...) is removed, an earlier config.json restored."""
        if self._fd is None:
            return
        root = self.run_dir.root
        for path in root.iterdir():
            if path.name in self._entries_before or path.name == LOCK_FILE:
                continue  # the lock file goes in release, while still held
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        if self._config_before is not None and self.run_dir.config.read_bytes() != self._config_before:
            self.run_dir.config.write_bytes(self._config_before)
        self._undone = True

    def release(self) -> None:
        """Let go of the lock (rank 0; a no-op elsewhere and when never taken)."""
        if self._fd is None:
            return
        root = self.run_dir.root
        if self._undone and LOCK_FILE not in self._entries_before and self._created_dir is False:
            self.run_dir.lock.unlink()  # still held: no other writer can be using it (see _try_lock's check)
        elif self._created_dir and [p.name for p in root.iterdir()] == [LOCK_FILE]:
            # Still holding the lock, so no other writer can be using the file or directory.
            self.run_dir.lock.unlink()
            root.rmdir()
        os.close(self._fd)  # closing the last descriptor releases the flock
        self._fd = None


def refuse_foreign_outputs(run_dir: RunDir, cfg: JobConfig) -> None:
    """A fresh run must not replace a config.json or metrics.jsonl some other run left here.

    Allowed under `checkpoint.resume`: the files are then the run's own, continued from its
    checkpoint, or under "auto" restarted in place when it has none yet (a crash before the
    first save; `True` without a checkpoint is refused by the checkpointer).

    Rank 0 looks and broadcasts what it found (collective): it is the rank that writes these
    files, so a peer that looked on its own could find the config rank 0 has just written
    for this very run and refuse it.
    """
    if cfg.checkpoint.resume:
        return
    outputs = (run_dir.config, run_dir.metrics)
    found_bits = 0
    if rank_and_world()[0] == 0:
        found_bits = sum(1 << i for i, path in enumerate(outputs) if path.exists())
    found_bits = broadcast_int(found_bits)
    found = [path.name for i, path in enumerate(outputs) if found_bits >> i & 1]
    if found:
        raise ConfigError(f"logging.run_dir = {str(run_dir.root)!r} already holds {' and '.join(found)} of another "
                          "run and no checkpoint: choose another --logging.run_dir, remove them, or pass "
                          "--checkpoint.resume auto to restart that run in place")
