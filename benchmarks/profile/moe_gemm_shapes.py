"""Why the MoE layer sits far below the GEMM peak on CPU: its GEMM shapes, hot and cold, float32 and bf16.

    .venv/bin/python benchmarks/profile/moe_gemm_shapes.py [--rounds 2] > benchmarks/results/moe_gemm_shapes.txt

One thread. (1) Best-of-30 GFLOP/s of single GEMMs at the 1024² probe shape `bench train`'s MFU uses
and at the expert shapes of qwen3_moe_debug (M tokens of one expert x dim 256 -> 2 x 768 and
768 -> 256), the same operands every repetition (cache-hot weights). (2) The layer's pattern: 64
experts, each its own 256 x 1536 weight, M rows each, best of 3 sweeps (the weights stream from
memory as in the layer). Rounds alternate the dtypes; on a shared machine compare within a round.
"""

from __future__ import annotations

import sys
import time

import torch


def hot_rate(m: int, k: int, n: int, dtype: torch.dtype, reps: int = 30) -> float:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9


def cold_rate(m: int, dtype: torch.dtype, experts: int = 64, k: int = 256, n: int = 1536) -> float:
    w, x = torch.randn(experts, k, n).to(dtype), torch.randn(experts, m, k).to(dtype)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for e in range(experts):
            torch.mm(x[e], w[e])
        best = min(best, time.perf_counter() - start)
    return experts * 2 * m * k * n / best / 1e9


def main(argv: list[str]) -> None:
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 2
    torch.set_num_threads(1)
    for round_ in range(rounds):
        for dtype in (torch.float32, torch.bfloat16):
            hot = {f"{m}x{k}x{n}": hot_rate(m, k, n, dtype)
                   for m, k, n in ((1024, 1024, 1024), (64, 256, 1536), (64, 768, 256), (128, 256, 1536))}
            cold = {f"M={m}": cold_rate(m, dtype) for m in (64, 128, 512)}
            print(f"round {round_} {str(dtype).removeprefix('torch.'):>8} hot GFLOP/s "
                  + ", ".join(f"{k} {v:.1f}" for k, v in hot.items())
                  + " | 64 experts, own weights: " + ", ".join(f"{k} {v:.1f}" for k, v in cold.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
