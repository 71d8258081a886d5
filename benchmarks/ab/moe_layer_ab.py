"""The memory-efficient MoE layer against the same-dtype GEMM peak, main (A) against this tree (B), alternating.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/ab/moe_layer_ab.py driver --baseline ../base [--rounds 3] [--json PATH]

One thread, process CPU time (the machine is shared: CPU time measures the work, not the queue).
Each round runs one fresh process per tree (A B, then B A): forward+backward of the routed experts
of one qwen3_moe_debug layer on a 2 x 512-token microbatch (1024 tokens, dim 256, 64 experts,
top-8, SwiGLU width 768) through `memory_efficient_experts`, best of 3 after a warm-up, float32
and bf16, plus the GEMM peak of each dtype in the same process (the best of 1024^2 and 2048^2, as
MFU's). The layer's FLOPs are its GEMMs' (`moetrain.bench.moe.layer_flops`'s closed form). Trees are run through
`benchmarks/ab/runner.py`. Benchmark only: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.ab import runner

MARKER = "LAYER_RESULT "
TOKENS, DIM, EXPERTS, TOP_K, WIDTH = 1024, 256, 64, 8, 768
FLOPS = 3 * 2 * TOKENS * TOP_K * DIM * 3 * WIDTH
PEAK_SIZES = (1024, 2048)  # as moetrain.observe.peak_flops, restated: tree A may predate it


def worker() -> None:
    import torch

    from moetrain.model.grouped_mm import grouped_mm_backend
    from moetrain.model.moe_function import memory_efficient_experts
    from moetrain.model.routing import routing_from_topk, select_experts
    from moetrain.observe.peak_flops import measure_gemm_flops  # in every tree since `bench moe --clock`

    torch.set_num_threads(1)
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(TOKENS, DIM, generator=g).to(dtype).requires_grad_()
        w1 = (torch.randn(EXPERTS, DIM, 2 * WIDTH, generator=g) * DIM**-0.5).to(dtype).requires_grad_()
        w2 = (torch.randn(EXPERTS, WIDTH, DIM, generator=g) * WIDTH**-0.5).to(dtype).requires_grad_()
        _, topk, gates = select_experts(torch.randn(TOKENS, EXPERTS, generator=g), "softmax", TOP_K, True)
        routing = routing_from_topk(topk, gates.to(dtype), EXPERTS)
        routing.scores = routing.scores.detach().requires_grad_()
        backend = grouped_mm_backend(x.device, dtype, "memory_efficient")

        def step(x=x, routing=routing, w1=w1, w2=w2, backend=backend):
            out = memory_efficient_experts(x, routing, w1, w2, "swiglu", backend)
            out.backward(torch.ones_like(out))

        step()
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            step()
            best = min(best, time.process_time() - start)
        peak = max(measure_gemm_flops(dtype, "cpu", 1, size=size, clock="cpu") for size in PEAK_SIZES)
        name = str(dtype).removeprefix("torch.")
        result[name] = {"layer_s": best, "layer_flops": FLOPS / best, "peak_flops": peak,
                        "fraction_of_peak": (FLOPS / best) / peak}
    print(MARKER + json.dumps({**result, "loadavg": os.getloadavg()[0]}), flush=True)


def driver(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="tree A: a checkout with src/")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args(argv)
    trees = runner.two_trees(opts.baseline)
    rows = []
    for round_, label in runner.alternate(["A", "B"], opts.rounds):
        result = runner.run(trees[label], [str(Path(__file__).resolve()), "worker"], marker=MARKER)
        row = {"tree": label, "round": round_, **result}
        rows.append(row)
        print(f"round {round_} {label}: " + " | ".join(
            f"{d} {1e3 * row[d]['layer_s']:.0f} ms, {row[d]['layer_flops'] / 1e9:.1f} GFLOP/s = "
            f"{100 * row[d]['fraction_of_peak']:.1f}% of {row[d]['peak_flops'] / 1e9:.0f}"
            for d in ("float32", "bfloat16")) + f" | load {row['loadavg']:.1f}", flush=True)
    summary = {}
    for d in ("float32", "bfloat16"):
        best = {t: min(r[d]["layer_s"] for r in rows if r["tree"] == t) for t in "AB"}
        frac = {t: max(r[d]["fraction_of_peak"] for r in rows if r["tree"] == t) for t in "AB"}
        summary[d] = {"A_best_s": best["A"], "B_best_s": best["B"], "speedup": best["A"] / best["B"],
                      "A_best_fraction_of_peak": frac["A"], "B_best_fraction_of_peak": frac["B"]}
        print(f"{d}: A {1e3 * best['A']:.0f} ms ({100 * frac['A']:.1f}% of peak), B {1e3 * best['B']:.0f} ms "
              f"({100 * frac['B']:.1f}% of peak), B/A speed {best['A'] / best['B']:.2f}x")
    if opts.json:
        runner.save(opts.json, {"rows": rows, "summary": summary})


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker()
    else:
        driver(sys.argv[2:] if sys.argv[1:2] == ["driver"] else sys.argv[1:])
