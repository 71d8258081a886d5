"""Where a training step's time goes: seconds per phase, measured on this rank.

`StepPhases` accumulates wall time into named phases (`PHASES`) around the parts of
`Trainer.train_step`: data (next microbatches, to device), forward (model, loss, router
terms, the global-balance pre-pass), backward, collectives (the step's own all-reduces:
the global token count), wait (the summary all-reduce: the time this rank waits for the
slowest) and optimizer (clipping, the update, zeroing, the expert-bias update). Under FSDP
the all-gathers and reduce-scatters run inside forward and backward and are counted there;
under expert parallelism the token all-to-alls also are (and are reported on their own as
`all_to_all_s`). On CUDA each phase boundary synchronises the device so kernels are charged
to the phase that launched them. This module measures; it must not change what a step does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

PHASES = ("data", "forward", "backward", "collectives", "wait", "optimizer")


class StepPhases:
    def __init__(self, device: torch.device):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._synchronize = device.type == "cuda"

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._synchronize:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._synchronize:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - start
