"""Graceful stops on SIGTERM/SIGINT, agreed by every rank at a step boundary.

Schedulers send SIGTERM some time before they kill a job; a terminal sends SIGINT on
Ctrl-C. `StopSignals` turns the first such signal into a flag (and one line on
rank 0); the run asks `agree(...)` at every step boundary, which is one tiny
all-reduce so every rank stops after the same step even when the signal reached
only some of them, and whether to save first (a save is due, or the last save is
older than `checkpoint.signal_save_after_s` on any rank). The run then exits with
EXIT_STOPPED_BY_SIGNAL and one line.

A second signal ends the process at once, without a checkpoint (exit 128 + signal
number, as a shell reports a signal death). A second signal within
SAME_EVENT_S of the first counts as the same request: under torchrun one Ctrl-C
reaches a rank twice, once from the terminal and once forwarded by torchrun. A rank
that does not reach a step boundary within `grace_s` of the first signal (it is
hung) ends the same way: its peers' collectives would have timed out by then.

This module handles signals and agrees on stopping; it must not save, log metrics or
decide the schedule (the run does).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any

import torch

from moetrain.parallel.collectives import all_reduce_sum, collective_device

# EX_TEMPFAIL from sysexits.h: stopped on request, resumable; neither success nor a crash.
EXIT_STOPPED_BY_SIGNAL = 75
SAME_EVENT_S = 1.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _say(line: str) -> None:
    # os.write, not print or logging: both take locks a signal handler may interrupt.
    os.write(2, (line + "\n").encode())


class StopSignals:
    """SIGTERM/SIGINT handlers for the life of a run (`with StopSignals(...) as stop:`)."""

    def __init__(self, rank: int, grace_s: float):
        self.rank = rank
        self.grace_s = grace_s
        self.signum: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}
        self._boundary_reached = threading.Event()

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __enter__(self) -> StopSignals:
        # Handlers can only be installed from the main thread; elsewhere (a library caller's
        # worker thread) signals keep their previous meaning.
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self._boundary_reached.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            if self.rank == 0:
                _say(f"moetrain: {signal.Signals(signum).name} received: stopping at the next step boundary "
                     "(send it again to exit at once, without a checkpoint)")
            threading.Thread(target=self._watchdog, daemon=True, name="moetrain-stop-watchdog").start()
        elif now - self._first_at > SAME_EVENT_S:
            _say(f"moetrain: rank {self.rank}: second signal ({signal.Signals(signum).name}): exiting now, "
                 "without a checkpoint")
            os._exit(128 + signum)

    def _watchdog(self) -> None:
        if not self._boundary_reached.wait(self.grace_s):
            _say(f"moetrain: rank {self.rank}: no step boundary within {self.grace_s:g} s of {self.name} "
                 "(parallel.collective_timeout_s): exiting now, without a checkpoint")
            os._exit(128 + (self.signum or signal.SIGTERM))

    def agree(self, save_wanted: bool) -> tuple[bool, bool]:
        """(stop, save) as every rank agrees: stop when any rank got a signal, save when any wants to.

        Collective: every rank calls it at the same step boundary (one 2-element all-reduce).
        """
        flags = torch.tensor([self.signum is not None, save_wanted], dtype=torch.int64, device=collective_device())
        stop, save = (int(v) > 0 for v in all_reduce_sum(flags).tolist())
        if stop:
            self._boundary_reached.set()
        return stop, stop and save
