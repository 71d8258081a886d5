"""How many intra-op threads a training process uses (`train.num_threads`).

A number > 0 is used as given. 0 means: the cores this process may run on, shared among the
ranks of this host, unless they are busy. Why the check: torch's OpenMP threads spin-wait for
each other at the end of every parallel region, so when another process holds one of the cores,
a step with two threads is far slower than with one. Measured on the 2-core development machine,
default job: idle, 2 threads gave 1.7x the tokens/s of 1; beside one busy process 0.6x; beside
two, between 0.06x and 0.9x (docs/training.md, "Threads"). So at start a short probe (0.4 s)
runs 512 x 512 float32 GEMMs with one thread and with all candidate threads in alternating 50 ms
blocks; all threads are used only when they do at least `SPEEDUP_NEEDED` times as many. The choice is made once,
at start; load that arrives later is not followed. The thread count changes the order of some
float sums: the default job's losses with 1 and 2 threads are equal to the bit for 60 steps, then
part (held-out 2.305 vs 2.277 bits per byte at step 800). So a bit-identical resume needs the same
count as the interrupted run: with 0, a resumed run takes the count its checkpoint recorded
instead of probing again; `train.num_threads` > 0 pins it.

When OMP_NUM_THREADS is set (torchrun sets 1 for each rank), torch already follows it and 0
leaves it alone. This module sets the thread count; it must not change what is computed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

SPEEDUP_NEEDED = 1.3
_PROBE_SIZE = 512
_PROBE_BLOCK_S = 0.05
_PROBE_ROUNDS = 4


def usable_cores() -> int:
    """Cores this process may be scheduled on (its CPU affinity), shared among this host's ranks."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def probe_speedup(threads: int, size: int = _PROBE_SIZE, block_s: float = _PROBE_BLOCK_S,
                  rounds: int = _PROBE_ROUNDS) -> float:
    """GEMMs per second with `threads` threads over those with one, in alternating blocks of `block_s`.

    Blocks of many GEMMs, not single ones: a busy machine deschedules a thread for whole
    scheduler slices (milliseconds), and single timings then swing 10x either way.
    """
    previous = torch.get_num_threads()
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    done = {1: 0, threads: 0}
    spent = {1: 0.0, threads: 0.0}
    try:
        torch.mm(a, b)  # first call: library and buffers set up, not timed
        for _ in range(rounds):
            for count in (1, threads):
                torch.set_num_threads(count)
                start = time.perf_counter()
                while (elapsed := time.perf_counter() - start) < block_s:
                    torch.mm(a, b)
                    done[count] += 1
                spent[count] += elapsed
    finally:
        torch.set_num_threads(previous)
    return (done[threads] / spent[threads]) / (done[1] / spent[1])


def choose_threads(requested: int, cores: int, speedup: Callable[[int], float]) -> tuple[int, str]:
    """(threads, why) for `train.num_threads = requested` on `cores` usable cores."""
    if requested > 0:
        return requested, "train.num_threads"
    if cores <= 1:
        return 1, "one usable core"
    measured = speedup(cores)
    if measured >= SPEEDUP_NEEDED:
        return cores, f"{cores} usable cores, GEMM {measured:.2f}x faster than with 1 thread"
    return 1, (f"{cores} usable cores but GEMM only {measured:.2f}x faster with {cores} threads "
               f"(< {SPEEDUP_NEEDED}x: cores busy)")


def set_intra_op_threads(requested: int, interrupted: int | None = None) -> str:
    """Apply `train.num_threads`; return a short description for the start log.

    `interrupted`: the count a resumed run's checkpoint recorded, used instead of a probe.
    """
    if requested <= 0 and "OMP_NUM_THREADS" in os.environ:
        return f"{torch.get_num_threads()} (OMP_NUM_THREADS)"
    if requested <= 0 and interrupted is not None:
        torch.set_num_threads(interrupted)
        return f"{interrupted} (the count the resumed checkpoint was trained with)"
    threads, why = choose_threads(requested, usable_cores(), probe_speedup)
    torch.set_num_threads(threads)
    return f"{threads} ({why})"
