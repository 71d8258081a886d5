"""The memory-efficient MoE layer against the GEMM peak, float32 and bf16, eager op path vs the old Function.

    PYTHONPATH=src .venv/bin/python benchmarks/profile/moe_layer_vs_gemm_peak.py [--rounds 5] [--json PATH]

In one process with one thread, rounds alternate: a 1024² GEMM (best of 8) per dtype, then
forward+backward of the memory-efficient routed experts at the qwen3_moe_debug shape (512
tokens, dim 256, 64 experts, top-8, expert width 768, SwiGLU) through the custom operator the
model now calls and through the `MemoryEfficientExperts` autograd Function it called before.
The layer's FLOPs are its GEMMs': the forward 2 · tokens · top_k · dim · 3 · width (W1 of width
2 · width for SwiGLU, then W2), the backward twice that (input and weight gradients). Reports the
best time per path and dtype and its fraction of the GEMM peak (best over rounds of each); on a
shared machine only these side-by-side ratios mean anything.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from moetrain.args import take_option
from moetrain.model.grouped_mm import grouped_mm_backend
from moetrain.model.moe_function import CPU_CHUNK_ROWS, MemoryEfficientExperts, memory_efficient_experts
from moetrain.model.routing import routing_from_topk, select_experts
from moetrain.observe.peak_flops import measure_gemm_flops

TOKENS, DIM, EXPERTS, TOP_K, WIDTH = 512, 256, 64, 8, 768


def inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, DIM, generator=g).to(dtype).requires_grad_()
    w1 = (torch.randn(EXPERTS, DIM, 2 * WIDTH, generator=g) * DIM**-0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(EXPERTS, WIDTH, DIM, generator=g) * WIDTH**-0.5).to(dtype).requires_grad_()
    logits = torch.randn(TOKENS, EXPERTS, generator=g)
    _, topk, gates = select_experts(logits, "softmax", TOP_K, True)
    routing = routing_from_topk(topk, gates.to(dtype), EXPERTS)
    routing.scores = routing.scores.detach().requires_grad_()  # a leaf: every pass backpropagates to it
    return x, w1, w2, routing


def fwd_bwd(path: str, x, w1, w2, routing) -> float:
    backend = grouped_mm_backend(x.device, x.dtype, "memory_efficient")
    start = time.perf_counter()
    if path == "operator":
        out = memory_efficient_experts(x, routing, w1, w2, "swiglu", backend)
    else:
        out = MemoryEfficientExperts.apply(x, routing.scores, w1, w2, routing.token_index, routing.counts, "swiglu",
                                           backend, CPU_CHUNK_ROWS)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    json_path, argv = take_option(argv, "json")
    rounds, argv = take_option(argv, "rounds")
    torch.set_num_threads(1)
    flops = 3 * 2 * TOKENS * TOP_K * DIM * 3 * WIDTH
    best: dict[str, float] = {}
    for _ in range(int(rounds or 5)):
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            peak = measure_gemm_flops(dtype, "cpu", threads=1)
            best[f"gemm_{name}"] = max(best.get(f"gemm_{name}", 0.0), peak)
            tensors = inputs(dtype)
            for path in ("operator", "function", "function", "operator"):
                seconds = fwd_bwd(path, *tensors)
                best[f"{path}_{name}_s"] = min(best.get(f"{path}_{name}_s", float("inf")), seconds)
    lines = [f"1 thread, {TOKENS} tokens, dim {DIM}, {EXPERTS} experts top-{TOP_K}, width {WIDTH}: "
             f"{flops / 1e9:.2f} GFLOP per forward+backward"]
    for name in ("float32", "bfloat16"):
        peak = best[f"gemm_{name}"]
        lines.append(f"{name}: GEMM peak {peak / 1e9:.1f} GFLOP/s")
        for path in ("operator", "function"):
            seconds = best[f"{path}_{name}_s"]
            lines.append(f"  {path:>9}: {seconds:.3f} s, {flops / seconds / 1e9:.1f} GFLOP/s, "
                         f"{100 * flops / seconds / peak:.1f}% of the GEMM peak")
    print("\n".join(lines))
    if json_path:
        Path(json_path).write_text(json.dumps({"flops": flops, "best": best}, indent=1))
        Path(json_path).with_suffix(".txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
