"""Start a lighthouse and replica groups of a fault-tolerant run as real processes, for tests and benchmarks.

`Lighthouse` runs `moetrain lighthouse` on a free port and reads its address; `ReplicaGroupJob` runs
one replica group as its own `torchrun --standalone` job (`stop()` SIGKILLs torchrun and every
rank it started at once, as a lost node would), and reads the group's train records
as they are written. Every process is killed and reaped on `stop()`. This module only starts,
watches and kills processes; it must not import the rest of moetrain (it sits below every layer).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (torchrun starts each rank in a session of its own, so sessions do not find them)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and every descendant at once (a lost node), then reap it."""
    for pid in [proc.pid, *_children(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def read_records(run_dir: Path, kind: str = "train") -> list[dict]:
    """The records of `kind` in a run directory's metrics file so far, in file order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if record.get("kind") == kind:
            out.append(record)
    return out


class Lighthouse:
    """`moetrain lighthouse` on a free port; `address` is the first line it printed."""

    def __init__(self, env: dict[str, str], min_replicas: int = 1, join_timeout_s: float = 0.5,
                 heartbeat_timeout_s: float = 1.5, timeout_s: float = 60):
        command = [sys.executable, "-m", "moetrain", "lighthouse", "--bind", "[::]:0", "--min-replicas",
                   str(min_replicas), "--join-timeout-s", str(join_timeout_s), "--heartbeat-timeout-s",
                   str(heartbeat_timeout_s)]
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        line = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
        if not line.startswith("http"):
            self.stop()
            raise RuntimeError(f"the lighthouse printed {line!r} instead of its address")
        self.address = line

    def stop(self) -> None:
        _kill_tree(self.proc)


class ReplicaGroupJob:
    """One replica group: `torchrun --standalone --nproc-per-node N -m moetrain train ARGS` in its own session."""

    def __init__(self, run_dir: Path, args: list[str], nproc: int, env: dict[str, str]):
        self.run_dir = Path(run_dir)
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        launch = 0  # a restarted group writes a log of its own
        while (self.run_dir.parent / f"{self.run_dir.name}.{launch}.stderr").exists():
            launch += 1
        self.log = self.run_dir.parent / f"{self.run_dir.name}.{launch}.stderr"
        command = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "-m", "moetrain", "train", *args]
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=True)

    def records(self, kind: str = "train") -> list[dict]:
        return read_records(self.run_dir, kind)

    def last_step(self) -> int:
        train = self.records()
        return train[-1]["step"] if train else 0

    def wait_for(self, predicate, timeout_s: float, what: str) -> None:
        """Poll until `predicate(self)` holds; RuntimeError naming `what` (and the log's tail) on a timeout or exit."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self):
            if self.proc.poll() is not None and not predicate(self):
                raise RuntimeError(f"{self.run_dir.name} exited ({self.proc.returncode}) before {what}:\n"
                                   f"{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.run_dir.name}: no {what} within {timeout_s:g} s:\n"
                                   f"{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def rank_pids(self) -> set[int]:
        """The process ids of torchrun and every process it started (the group's ranks)."""
        return {self.proc.pid, *_children(self.proc.pid)}

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"{self.run_dir.name} did not finish within {timeout_s:g} s:\n"
                               f"{self.log.read_text()[-3000:]}") from None

    def stop(self) -> None:
        """SIGKILL torchrun and every rank of the group at once (a lost node)."""
        _kill_tree(self.proc)
