"""Peak memory of this process over a window of steps: RSS high-water mark on CPU, max allocated/reserved on CUDA.

`PeakMemory.read_and_reset()` returns this process's peaks since the previous call (or
since construction) and starts a new window, so the trainer can put "peak memory since the
previous record" into every step record (with `logging.log_every = 1`: per step).

CPU: the resident set's high-water mark is Linux's VmHWM (/proc/self/status). Writing "5" to
/proc/self/clear_refs resets it to the current RSS (Linux >= 4.0), which makes a per-window
peak possible. Where that file is not writable (or /proc is missing) the peak falls back to
`resource.getrusage(...).ru_maxrss`, the lifetime peak, and `window_peaks` is False so that
readers know the number never decreases. CUDA: `torch.cuda.max_memory_allocated/reserved`,
reset with `reset_peak_memory_stats`.

This module only measures: it does no collectives (the trainer gathers every rank's values)
and allocates no tensors.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK_RSS = "5"  # see proc(5), /proc/pid/clear_refs


def _status_bytes(field: str) -> int | None:
    """A "kB" field of /proc/self/status in bytes (None where /proc is unavailable)."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def _lifetime_peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB on Linux


def current_rss_bytes() -> int:
    """The resident set size now (0 where /proc is unavailable)."""
    return _status_bytes("VmRSS") or 0


class PeakMemory:
    """This process's peak memory per window; `device` decides whether CUDA peaks are read too."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.window_peaks = self._reset_rss_peak()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    @staticmethod
    def _reset_rss_peak() -> bool:
        try:
            _CLEAR_REFS.write_text(_RESET_PEAK_RSS)
        except OSError:
            return False
        return _status_bytes("VmHWM") is not None

    def read_and_reset(self) -> dict[str, float]:
        """Peaks since the last call, in bytes: peak_rss, rss (now) and, on CUDA, max allocated and reserved."""
        peak_rss = _status_bytes("VmHWM") if self.window_peaks else None
        values = {"peak_rss": float(peak_rss if peak_rss is not None else _lifetime_peak_rss_bytes()),
                  "rss": float(current_rss_bytes())}
        if self.cuda:
            values["cuda_max_allocated"] = float(torch.cuda.max_memory_allocated(self.device))
            values["cuda_max_reserved"] = float(torch.cuda.max_memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.window_peaks:
            self._reset_rss_peak()
        return values


def growth_per_step(steps: list[int], values: list[float]) -> float:
    """Least-squares slope of `values` against `steps` (bytes per step for memory readings); 0 for < 2 points."""
    if len(steps) < 2:
        return 0.0
    mean_step = sum(steps) / len(steps)
    mean_value = sum(values) / len(values)
    covariance = sum((s - mean_step) * (v - mean_value) for s, v in zip(steps, values, strict=True))
    variance = sum((s - mean_step) ** 2 for s in steps)
    return covariance / variance if variance else 0.0
