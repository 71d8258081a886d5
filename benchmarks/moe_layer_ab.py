"""The memory-efficient MoE layer against the same-dtype GEMM peak, main (A) against this tree (B), alternating.

    PYTHONPATH=src .venv/bin/python benchmarks/moe_layer_ab.py driver --baseline /work/wt/r26c_base [--rounds 3]

One thread, process CPU time (the machine is shared: CPU time measures the work, not the queue).
Each round runs one fresh process per tree (A B, then B A): forward+backward of the routed experts
of one qwen3_moe_debug layer on a 2 x 512-token microbatch (1024 tokens, dim 256, 64 experts,
top-8, SwiGLU width 768) through `memory_efficient_experts`, best of 3 after a warm-up, float32
and bf16, plus the 1024^2 GEMM peak of each dtype in the same process. The layer's FLOPs are its
GEMMs' (`moetrain.bench.moe.layer_flops`'s closed form). Benchmark only: nothing asserts a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
TOKENS, DIM, EXPERTS, TOP_K, WIDTH = 1024, 256, 64, 8, 768
FLOPS = 3 * 2 * TOKENS * TOP_K * DIM * 3 * WIDTH


def worker() -> None:
    import torch

    from moetrain.model.grouped_mm import grouped_mm_backend
    from moetrain.model.moe_function import memory_efficient_experts
    from moetrain.model.routing import routing_from_topk, select_experts

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
        a, b = torch.randn(1024, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
        torch.mm(a, b)
        gemm = float("inf")
        for _ in range(8):
            start = time.process_time()
            torch.mm(a, b)
            gemm = min(gemm, time.process_time() - start)
        name = str(dtype).removeprefix("torch.")
        result[name] = {"layer_s": best, "layer_flops": FLOPS / best, "peak_flops": 2 * 1024**3 / gemm,
                        "fraction_of_peak": (FLOPS / best) / (2 * 1024**3 / gemm)}
    print(json.dumps({**result, "loadavg": os.getloadavg()[0]}), flush=True)


def driver(argv: list[str]) -> None:
    baseline = Path(argv[argv.index("--baseline") + 1]).resolve()
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 3
    out = Path(argv[argv.index("--json") + 1]) if "--json" in argv else None
    rows = []
    for round_ in range(rounds):
        for label in ("AB" if round_ % 2 == 0 else "BA"):
            tree = baseline if label == "A" else HERE
            proc = subprocess.run([sys.executable, str(HERE / "benchmarks/moe_layer_ab.py"), "worker"], cwd=tree,
                                  env={**os.environ, "PYTHONPATH": str(tree / "src")}, capture_output=True, text=True,
                                  check=True)
            row = {"tree": label, "round": round_, **json.loads(proc.stdout.strip().splitlines()[-1])}
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
    if out:
        out.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    worker() if sys.argv[1] == "worker" else driver(sys.argv[2:])
