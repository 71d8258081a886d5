"""The FLOP/s a run's MFU is measured against: measured on the spot, never assumed.

On CPU the peak is what a dense GEMM reaches here and now: `measure_gemm_flops` times
square matrix products at the run's compute dtype and the process's intra-op thread
count, keeping the best of several repetitions (the least disturbed by other work on
the machine). On CUDA it is the device's published dense (no sparsity) tensor-core peak
for the dtype when the device is known, else the same GEMM measurement. `train.peak_flops`
> 0 overrides both. This module measures; it must not change what training computes.
"""

from __future__ import annotations

import functools
import time

import torch

# Dense peaks (FLOP/s, no structured sparsity) from the vendors' data sheets, SXM parts.
_CUDA_DENSE_PEAKS: dict[str, dict[torch.dtype, float]] = {
    "H200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 66.9e12},
    "H100": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 66.9e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
}


@functools.cache
def measure_gemm_flops(dtype: torch.dtype, device_type: str = "cpu", threads: int = 0, size: int = 1024,
                       repeats: int = 8, clock: str = "wall") -> float:
    """Best FLOP/s of `repeats` products of two size x size matrices (after one warm-up), at `threads` threads.

    threads = 0 uses the current setting. clock "cpu" (CPU only) times with the process's CPU time
    instead of the wall clock: FLOPs per CPU-second, what a benchmark on a shared, oversubscribed
    machine can compare against its own CPU time. Cached per arguments: a process measures each once.
    """
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


def peak_flops(dtype: torch.dtype, device: torch.device) -> float:
    """The peak FLOP/s of one rank at `dtype` on `device` (see the module docstring)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for model, peaks in _CUDA_DENSE_PEAKS.items():
            if model in name and dtype in peaks:
                return peaks[dtype]
        return measure_gemm_flops(dtype, "cuda", size=8192)
    return measure_gemm_flops(dtype, "cpu", torch.get_num_threads())
