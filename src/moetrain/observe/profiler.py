"""The profiler window: a torch.profiler trace of steps A..B (`profile.steps = "A-B"`), one Chrome trace per rank.

The run wraps every optimizer step in `ProfilerWindow.step(n)`: the profiler starts before
step A, each traced step is labelled "step n" (a `record_function` range), and after step
B this rank writes RUN_DIR/profile/rank{R}_steps{A}-{B}.json (open it in Perfetto or
chrome://tracing). A run that ends inside the window (stop_at_step, an error) writes what
it traced on `close()`. CPU activity always, CUDA kernels too when the run is on a GPU.
This module decides nothing about the run and never touches the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from moetrain.logging import get_logger

log = get_logger("train")


class ProfilerWindow:
    """Profiles the steps in `steps` (inclusive bounds; None = never) and writes this rank's trace to `out_dir`."""

    def __init__(self, steps: tuple[int, int] | None, out_dir: Path, rank: int, device: torch.device):
        self.steps = steps
        self.device = device
        self.path = out_dir / (f"rank{rank}_steps{steps[0]}-{steps[1]}.json" if steps else "")
        self._profiler: profile | None = None

    @contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Around optimizer step `number` (the step count once it is done, as in the log)."""
        if self.steps is None or not self.steps[0] <= number <= self.steps[1]:
            yield
            return
        if self._profiler is None:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
            self._profiler.start()
        with record_function(f"step {number}"):
            yield
        if number == self.steps[1]:
            self.close()

    def close(self) -> None:
        """Stop and write the trace if the window is open (idempotent)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))
        log.info("profiler trace written: %s", self.path)
