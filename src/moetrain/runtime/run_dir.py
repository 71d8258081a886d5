"""The layout of a run directory and the config a run stored there.

RUN_DIR/config.json (the run's resolved JobConfig), metrics.jsonl (records, see
`moetrain.observe.metrics`), checkpoints/step_XXXXXXXX/ (see `moetrain.checkpoint`),
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
a crashed run never leaves a lock that blocks its resume. The file stays after a run
that wrote something; a run that wrote nothing (refused) removes the lock file it
created, while still holding it, so the directory is as it was. Removing it is safe
because every taker checks, once it holds the lock, that the file it locked is still
the one at the path (else it takes the new one).

A lock file deleted while a run holds it (by hand, by a cleanup job) would let a second
run take a new one and both write. The holder notices (`check_held`, once per step): it
takes the lock again on a new file when nobody else has, else it stops in one line
before writing anything more, leaving the directory to the run that holds it now.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetrain.config.job import JobConfig, from_dict
from moetrain.errors import ConfigError
from moetrain.logging import get_logger
from moetrain.parallel.collectives import broadcast_int, rank_and_world

log = get_logger("run_dir")

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
LOCK_FILE = "run.lock"


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        # Callers pass str or Path; every property joins paths, which a str cannot.
        object.__setattr__(self, "root", Path(self.root))

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

    @property
    def wandb_run_id(self) -> Path:
        """The W&B run id of this job, kept so that a restarted job resumes its run instead of opening another."""
        return self.root / "wandb_run_id"

    def load_config(self) -> JobConfig:
        """The JobConfig a training run saved here (one-line ConfigError when missing or bad)."""
        if not self.config.is_file():
            raise ConfigError(f"--run {str(self.root)!r} has no {CONFIG_FILE}; pass the logging.run_dir of a "
                              "training run")
        try:
            stored = json.loads(self.config.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise ConfigError(f"{self.config} is not valid JSON: {str(err).splitlines()[0]}") from None
        if not isinstance(stored, dict):
            raise ConfigError(f"{self.config} does not hold a JSON object (a run's config)")
        return from_dict(stored).validate()


class WriterLock:
    """The exclusive writer lock of a run directory, held by rank 0 from `acquire` to `release`.

    `acquire` is collective (every rank calls it): rank 0 tries the lock without waiting
    and broadcasts whether it got it; on every rank a lock held by another process is a
    one-line ConfigError naming the holder. A lock file (and a directory) the lock had to
    create is removed again at `release` when the run wrote nothing to the directory (its
    entries' sizes and times are as at `acquire`), so a refused run leaves nothing behind.
    """

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self._fd: int | None = None
        self._created_dir = False
        self._created_file = False
        self._before: dict[str, Any] = {}  # the directory's entries when the lock was taken
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
        self._created_file = not self.run_dir.lock.exists()
        self._before = self._entries()
        refusal = self._lock_current_file()
        if refusal:
            self._created_file = False  # the holder's file, not ours
        else:
            self._config_before = self.run_dir.config.read_bytes() if self.run_dir.config.is_file() else None
        return refusal

    def _entries(self) -> dict[str, Any]:
        """Name -> (size, mtime) of each entry of the run directory but the lock: what a run's writes change."""
        entries = {}
        for entry in os.scandir(self.run_dir.root):
            if entry.name != LOCK_FILE:
                info = entry.stat(follow_symlinks=False)
                entries[entry.name] = (info.st_size, info.st_mtime_ns)
        return entries

    def _is_ours(self) -> bool:
        """Whether the file at the lock's path is the one this lock holds."""
        try:
            return self._fd is not None and os.fstat(self._fd).st_ino == os.stat(self.run_dir.lock).st_ino
        except FileNotFoundError:
            return False

    def _lock_current_file(self) -> str:
        """flock the file at the lock's path (created if missing) into self._fd; '' on success, else why not."""
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
        return ""

    def undo_start(self) -> None:
        """Put the directory back as `acquire` found it, after a start refused before its first step (rank 0):
        what appeared since (config.json, metrics.jsonl, logs/, ...) is removed, an earlier config.json restored."""
        if self._fd is None:
            return
        root = self.run_dir.root
        for path in root.iterdir():
            if path.name in self._before or path.name == LOCK_FILE:
                continue  # the lock file goes in release, while still held
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        if self._config_before is not None and self.run_dir.config.read_bytes() != self._config_before:
            self.run_dir.config.write_bytes(self._config_before)
        self._undone = True

    def check_held(self) -> None:
        """Collective: make sure the lock file at the path is still this run's; stop (ConfigError) if another run's.

        Rank 0 compares the file it holds with the one at the path. When the file was deleted or
        replaced, it locks the file now there (creating it); if another run already holds that one,
        every rank raises one line and writes nothing more.
        """
        refusal = ""
        if self._fd is not None and not self._is_ours():
            held = self._fd
            self._fd = None
            try:
                refusal = self._lock_current_file()
            except OSError as err:
                refusal = f"cannot create its lock file again: {err.strerror}"
            if refusal:
                self._fd = held  # still ours to close at release; the directory is not
                self._created_file = self._created_dir = False
            else:
                os.close(held)
                log.warning("%s was removed or replaced while this run held it; locked it again", self.run_dir.lock)
        if broadcast_int(1 if refusal else 0) == 0:
            return
        raise ConfigError(f"logging.run_dir = {str(self.run_dir.root)!r}: its {LOCK_FILE} was removed while this run "
                          "wrote there, and another training run holds it now; this run stops without writing "
                          "more (resume it once the other has ended, or use another --logging.run_dir)")

    def release(self) -> None:
        """Let go of the lock (rank 0; a no-op elsewhere and when never taken)."""
        if self._fd is None:
            return
        root = self.run_dir.root
        # Still holding the lock, so no other writer can be using the file or directory.
        if self._created_file and self._is_ours() and (self._undone or self._entries() == self._before):
            self.run_dir.lock.unlink()  # the run wrote nothing (or its start was undone): as it was
            if self._created_dir and not any(root.iterdir()):
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
