"""Host (CPU) memory reuse: large tensors come from the heap and freed memory stays for the next step.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh
mmap and unmaps it on free, so each step's large CPU tensors (a layer's expert-weight
gradients are 100 MiB on the Qwen3-MoE debug shape, the activations of a long row too)
are new zero-filled pages every time: page faults and zeroing cost more than the GEMMs
that fill them. `reuse_freed_host_memory` turns glibc's mmap path off (M_MMAP_MAX = 0)
and raises its trim threshold, so freed blocks are reused by the next step's tensors of
the same sizes. Measured on qwen3_moe_debug, one process, 128-token rows: the backward
took 2-3x less time (docs/performance.md, "Step time"). The heap then keeps its
high-water mark instead of returning memory between steps; the peak itself is unchanged.

One process only: with several ranks on one host each rank's heap then keeps its own high-water
mark, and on 4 gloo ranks of qwen3_moe_debug (128-token rows) a rank grew to 6.3 GB of anonymous
memory, killed by the OOM killer on a 24 GiB machine, where the same job without the setting
peaked at 2.5 GB per rank (benchmarks/step_time_ab.py, side by side). Only on glibc (Linux);
elsewhere it does nothing. This module sets process-wide
allocator options; it must not allocate tensors or change what is computed.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_MAX_INT = 2**31 - 1


def reuse_freed_host_memory(world_size: int) -> bool:
    """Apply the glibc options above to a one-process job; return whether they took effect."""
    if world_size != 1:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _MAX_INT))
