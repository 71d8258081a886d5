"""glibc's `mallopt`, for the modules that tune the C heap (runtime.allocator, data.prepare.streaming).

One place loads the C library and declares the function's signature. This module only finds the
function; it must not choose or apply any heap setting (its callers own those and why they set them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """The C library's `mallopt(param, value)` (returns 1 on success, 0 on error), or None where there is no C
    library or it has no mallopt (not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt
