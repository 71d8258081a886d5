"""The GEMM attention against SDPA's CPU flash kernel, forward + backward, one thread, process CPU time.

    PYTHONPATH=src .venv/bin/python benchmarks/profile/gemm_attention.py [--json benchmarks/results/gemm_attention.json]

Both paths run through `attention.attend` on the same inputs: the GEMM path below its size bound
(the default), the flash kernel with the bound set to 0 (what main runs). Shapes: qwen3_moe_debug's
attention on a 2 x 512 microbatch (16 query heads, 8 kv heads, head_dim 128) as one causal row
per sequence and as a document-masked "dense" plan, plus 2 x 1024 rows. Best of 3 per path,
alternating flash and GEMM in each round, with the trainer's allocator setting (freed memory
reused). Benchmark only: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import moetrain.model.gemm_attention as gemm_attention
from moetrain.model.attention import attend, plan_attention
from moetrain.runtime.allocator import reuse_freed_host_memory

SHAPES = [("causal", 2, 512), ("dense documents", 2, 512), ("causal", 2, 1024)]


def fwd_bwd(q, k, v, grad, plan) -> float:
    start = time.process_time()
    attend(q, k, v, plan).backward(grad)
    return time.process_time() - start


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    reuse_freed_host_memory(1)
    bound = gemm_attention.GEMM_ATTENTION_MAX_SCORES
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for kind, batch, seq in SHAPES:
            gen = torch.Generator().manual_seed(0)
            q, k, v, grad = (torch.randn(batch, seq, heads, 128, generator=gen).to(dtype)
                             for heads in (16, 8, 8, 16))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            ids = None
            if kind != "causal":  # documents of 100, 200 and the rest in each row
                ids = torch.bucketize(torch.arange(seq), torch.tensor([100, 300]), right=True).expand(batch, seq)
            plan = plan_attention(ids, "dense") if ids is not None else None
            best = {"flash": float("inf"), "gemm": float("inf")}
            for _ in range(opts.rounds):
                for path, limit in (("flash", 0), ("gemm", max(bound, batch * 16 * seq * seq))):
                    gemm_attention.GEMM_ATTENTION_MAX_SCORES = limit
                    best[path] = min(best[path], fwd_bwd(q, k, v, grad, plan))
            gemm_attention.GEMM_ATTENTION_MAX_SCORES = bound
            # attention FLOPs of the causal half: 2 GEMMs forward, 4 backward (flash's recompute not counted)
            flops = 6 * 2 * batch * 16 * seq * seq * 128 / 2
            row = {"dtype": str(dtype).removeprefix("torch."), "kind": kind, "batch": batch, "seq": seq,
                   "flash_ms": 1e3 * best["flash"], "gemm_ms": 1e3 * best["gemm"],
                   "speedup": best["flash"] / best["gemm"], "flash_gflops": flops / best["flash"] / 1e9,
                   "gemm_gflops": flops / best["gemm"] / 1e9, "within_bound": batch * 16 * seq * seq <= bound,
                   "loadavg": os.getloadavg()[0]}
            rows.append(row)
            print(f"{row['dtype']:8s} {kind:16s} {batch}x{seq}: flash {row['flash_ms']:6.1f} ms "
                  f"({row['flash_gflops']:5.1f} GFLOP/s causal) | GEMM {row['gemm_ms']:6.1f} ms "
                  f"({row['gemm_gflops']:5.1f}) | {row['speedup']:.2f}x | within the bound: {row['within_bound']} "
                  f"| load {row['loadavg']:.1f}", flush=True)
    if opts.json:
        opts.json.write_text(json.dumps({"rows": rows, "argv": sys.argv, "torch": torch.__version__}, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
