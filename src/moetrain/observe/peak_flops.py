"""The FLOP/s a run's MFU is measured against: the peak of the threads and dtype the run uses.

On CUDA it is the device's published dense (no sparsity) tensor-core peak for the dtype when
the device is known, else a GEMM measurement. `train.peak_flops` > 0 overrides both.

On CPU the peak is what a dense GEMM reaches on this machine at the run's compute dtype with
the run's thread count: the best of square products of `PEAK_SIZES` (one size alone undersells
some kernels, so a run's own larger GEMMs could beat it: docs/results.md, "The peak over GEMM
sizes"), measured once while the cores are idle and cached per machine and
setting (`gemm_peaks.json` in moetrain's cache directory), so a run started beside other work
divides by the same peak as one started alone. A peak probed under load is lower than the
machine's, which is how a training log once printed an MFU of 190%. When no idle measurement
is cached and the cores are busy, the peak is estimated instead from one thread's FLOPs per
CPU-second (which other processes do not dilute) times the thread count, and not cached.

The CPU probe runs in a fresh interpreter (`python -m moetrain.observe.peak_flops`), never in the
training process: its 2048^2 operands are 48 MiB, and a one-process job keeps freed memory in its
heap (moetrain.runtime.allocator), so a probe run in-process left that much resident slack, which
then hid the job's own growth from its RSS (docs/results.md, "The peak over GEMM sizes").

Ranks of one host share its cores: each rank's peak is the host's peak at the threads its
ranks can run at once (at most the cores) divided by the ranks, so 4 one-thread ranks on 2
cores are measured against 2 cores, not 4. This module measures; it must not change what
training computes.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from moetrain.durable import write_json_atomically

# Dense peaks (FLOP/s, no structured sparsity) from the vendors' data sheets, SXM parts.
_CUDA_DENSE_PEAKS: dict[str, dict[torch.dtype, float]] = {
    "H200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 66.9e12},
    "H100": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 66.9e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
}
CACHE_ENV = "MOETRAIN_CACHE_DIR"
PEAK_SIZES = (1024, 2048)  # square GEMMs the CPU peak is the best of
# Idle enough to measure: the threads to be measured find at least this share of a core free each.
_IDLE_SHARE = 0.85


@functools.cache
def measure_gemm_flops(dtype: torch.dtype, device_type: str = "cpu", threads: int = 0, size: int = 1024,
                       repeats: int = 8, clock: str = "wall") -> float:
    """Best FLOP/s of `repeats` products of two size x size matrices (after one warm-up), at `threads` threads.

    threads = 0 uses the current setting. clock "cpu" (CPU only) times with the process's CPU time
    instead of the wall clock: FLOPs per CPU-second, what a benchmark on a shared, oversubscribed
    machine can compare against its own CPU time. Cached per arguments: a process measures each once.
    """
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', not {clock!r}")
    timer = time.perf_counter if clock == "wall" else time.process_time
    previous = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        generator = torch.Generator(device=device_type).manual_seed(0)
        a = torch.randn(size, size, generator=generator, device=device_type).to(dtype)
        b = torch.randn(size, size, generator=generator, device=device_type).to(dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            if device_type == "cuda":
                torch.cuda.synchronize()
            start = timer()
            torch.mm(a, b)
            if device_type == "cuda":
                torch.cuda.synchronize()
            best = min(best, timer() - start)
        return 2.0 * size**3 / best
    finally:
        torch.set_num_threads(previous)


def best_gemm_flops(dtype: torch.dtype, device_type: str = "cpu", threads: int = 0, clock: str = "wall") -> float:
    """The best FLOP/s over square products of each of `PEAK_SIZES` (see `measure_gemm_flops`)."""
    return max(measure_gemm_flops(dtype, device_type, threads, size=size, clock=clock) for size in PEAK_SIZES)


def gemm_peak_in_fresh_process(dtype: torch.dtype, threads: int, clock: str = "wall") -> float:
    """`best_gemm_flops` on the CPU in a child interpreter: this process's heap and threads stay as they are."""
    command = [sys.executable, "-m", "moetrain.observe.peak_flops", str(dtype).removeprefix("torch."),
               str(threads), clock]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the GEMM peak probe ({' '.join(command[1:])}) failed: {last}")
    return float(done.stdout.split()[-1])


def idle_cores(interval_s: float = 0.25) -> float | None:
    """How many cores were idle over the next `interval_s` (from /proc/stat), or None where it cannot be read."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields[:8])  # idle + iowait, all but guest time (counted in user)
    try:
        idle0, total0 = sample()
        time.sleep(interval_s)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (os.cpu_count() or 1) * (idle1 - idle0) / max(total1 - total0, 1)


def cache_path() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                     "moetrain")
    return Path(base) / "gemm_peaks.json"


def machine_key(dtype: torch.dtype, threads: int) -> str:
    """What a cached peak is valid for: the processor, its core count, torch's version, the dtype, threads and sizes."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} | {os.cpu_count()} cores | torch {torch.__version__} | {str(dtype).removeprefix('torch.')} | " \
           f"{threads} threads | gemm {','.join(map(str, PEAK_SIZES))}"


def _read_cache(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, int | float)} if isinstance(data, dict) else {}


def cpu_peak_flops(dtype: torch.dtype, threads: int) -> tuple[float, str]:
    """(FLOP/s of `threads` CPU threads at `dtype`, its source: "cached", "measured idle" or "busy estimate")."""
    path, key = cache_path(), machine_key(dtype, threads)
    cached = _read_cache(path)
    if key in cached:
        return cached[key], "cached"
    free = idle_cores()
    if free is not None and free >= _IDLE_SHARE * threads:
        peak = gemm_peak_in_fresh_process(dtype, threads)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomically(path, {**_read_cache(path), key: peak})
        except OSError:
            pass  # an unwritable cache only costs the next run a measurement
        return peak, "measured idle"
    return threads * gemm_peak_in_fresh_process(dtype, 1, clock="cpu"), "busy estimate"


def rank_peak_flops(dtype: torch.dtype, device: torch.device, threads: int | None = None,
                    local_ranks: int = 1, cores: int | None = None) -> tuple[float, str]:
    """(one rank's peak FLOP/s, its source) when `local_ranks` ranks of `threads` threads share this host."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for model, peaks in _CUDA_DENSE_PEAKS.items():
            if model in name and dtype in peaks:
                return peaks[dtype], "data sheet"
        return measure_gemm_flops(dtype, "cuda", size=8192), "measured"
    threads = threads or torch.get_num_threads()
    host_threads = min(threads * local_ranks, cores or os.cpu_count() or 1)
    peak, source = cpu_peak_flops(dtype, host_threads)
    return peak / local_ranks, source


if __name__ == "__main__":  # the child of `gemm_peak_in_fresh_process`: dtype threads clock -> FLOP/s
    print(best_gemm_flops(getattr(torch, sys.argv[1]), "cpu", int(sys.argv[2]), clock=sys.argv[3]))
