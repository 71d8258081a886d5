"""The GEMMs of a real training step, by kind, against the same shapes run again in isolation.

    PYTHONPATH=src .venv/bin/python benchmarks/profile/expert_gemm_in_step.py [--dtype bfloat16] [--threads 2] \
        [--warmup 1] [--out benchmarks/results/expert_gemm_in_step_bfloat16_2threads]

Builds the Trainer as `moetrain bench train` does for qwen3_moe_debug at the issue's shape
(vocabulary 2048, one microbatch of 2 x 512 tokens; `bf16_step_profile.issue_shape_trainer`),
takes `--warmup` steps, then profiles one step
(torch.profiler, CPU, input shapes recorded) and sorts every `aten::mm` by its shapes into:

  projections   the attention projections and the LM head (a row count of 1024 or 2048 tokens
                against the attention widths 2048 / 1024 or the vocabulary), and their gradients;
  expert rows   one expert's rows times its weight: (M, 256) x (256, 1536), (M, 768) x (768, 256)
                and the backward's (M, 256) x (256, 768), (M, 1536) x (1536, 256);
  expert wgrad  one expert's weight gradient X_e^T dY_e: (256, M) x (M, 1536), (768, M) x (M, 256);

expert GEMMs bucketed by their row count M. For each bucket it prints the step's self time,
GFLOP and GFLOP/s, then replays exactly those shapes (same count of each) twice on fresh operands
in isolation and reports both passes: the first creates oneDNN's matmul primitive for every shape
not seen before (bf16 matmuls on CPU go through oneDNN, which builds one per shape), the second
("hot") finds them all created and the small operands in cache: the rate the same GEMMs reach
outside the step.
qwen3_moe_debug's expert widths (1536, 768) differ from its attention widths, so the sort is
unambiguous for this model; it is written for this one. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
from benchmarks.profile.bf16_step_profile import issue_shape_trainer
from torch.profiler import ProfilerActivity, profile

DIM, EXPERT_HIDDEN = 256, 768
ROW_WEIGHTS = {(DIM, 2 * EXPERT_HIDDEN), (EXPERT_HIDDEN, DIM), (DIM, EXPERT_HIDDEN), (2 * EXPERT_HIDDEN, DIM)}
WGRAD_OUTPUTS = {(DIM, 2 * EXPERT_HIDDEN), (EXPERT_HIDDEN, DIM)}
BUCKETS = (32, 64, 128, 256)  # upper bounds (exclusive) of the row-count buckets; the last is open


def kind_of(m: int, k: int, n: int) -> tuple[str, int | None]:
    """('projections', None), ('expert rows', rows) or ('expert wgrad', rows) for an mm (m, k) x (k, n)."""
    if (k, n) in ROW_WEIGHTS and m not in (1024, 2048):
        return "expert rows", m
    if (m, n) in WGRAD_OUTPUTS and k not in (1024, 2048):
        return "expert wgrad", k
    return "projections", None


BUCKET_NAMES = ["all", *(f"< {bound}" for bound in BUCKETS), f">= {BUCKETS[-1]}"]


def bucket_of(rows: int | None) -> str:
    if rows is None:
        return "all"
    for bound in BUCKETS:
        if rows < bound:
            return f"< {bound}"
    return f">= {BUCKETS[-1]}"


def replay(shapes: list[tuple[int, int, int, int]], dtype: torch.dtype) -> tuple[float, float]:
    """Seconds of the first and second of two passes over `shapes` ((m, k, n, count) each) on fresh operands."""
    operands = [(torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype))
                for m, k, n, count in shapes for _ in range(count)]
    passes = []
    for _ in range(2):
        start = time.perf_counter()
        for a, b in operands:
            torch.mm(a, b)
        passes.append(time.perf_counter() - start)
    return passes[0], passes[1]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, help="writes OUT.json and OUT.txt")
    args = parser.parse_args(argv)
    trainer = issue_shape_trainer(args.dtype, args.threads)
    for _ in range(args.warmup):
        trainer.train_step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        trainer.train_step()
        step_s = time.perf_counter() - start

    groups: dict[tuple[str, str], dict] = collections.defaultdict(lambda: {"s": 0.0, "flop": 0, "calls": 0,
                                                                          "shapes": []})
    for evt in prof.key_averages(group_by_input_shape=True):
        if evt.key != "aten::mm" or len(evt.input_shapes) < 2 or len(evt.input_shapes[0]) != 2:
            continue
        (m, k), (_, n) = evt.input_shapes[0], evt.input_shapes[1]
        kind, rows = kind_of(m, k, n)
        group = groups[(kind, bucket_of(rows))]
        group["s"] += evt.self_cpu_time_total / 1e6
        group["flop"] += 2 * m * k * n * evt.count
        group["calls"] += evt.count
        group["shapes"].append((m, k, n, evt.count))

    dtype = getattr(torch, args.dtype)
    order = {"projections": 0, "expert rows": 1, "expert wgrad": 2}
    rows_out = []
    for (kind, bucket), group in sorted(groups.items(),
                                        key=lambda kv: (order[kv[0][0]], BUCKET_NAMES.index(kv[0][1]))):
        first_s, hot_s = replay(group["shapes"], dtype)
        rows_out.append({"kind": kind, "rows": bucket, "calls": group["calls"], "step_s": group["s"],
                         "gflop": group["flop"] / 1e9, "step_gflops": group["flop"] / group["s"] / 1e9,
                         "first_s": first_s, "first_gflops": group["flop"] / first_s / 1e9,
                         "hot_s": hot_s, "hot_gflops": group["flop"] / hot_s / 1e9})
    lines = [f"qwen3_moe_debug, vocabulary 2048, 2 x 512 tokens, {args.dtype}, {torch.get_num_threads()} threads: "
             f"one profiled step {step_s:.2f} s (after {args.warmup} warm-up)",
             f"{'kind':13s} {'rows':>6s} {'calls':>6s} {'step s':>7s} {'GFLOP':>7s} {'in step GFLOP/s':>16s} "
             f"{'isolated, 1st':>14s} {'isolated, hot':>14s}"]
    for r in rows_out:
        lines.append(f"{r['kind']:13s} {r['rows']:>6s} {r['calls']:6d} {r['step_s']:7.3f} {r['gflop']:7.1f} "
                     f"{r['step_gflops']:16.1f} {r['first_gflops']:14.1f} {r['hot_gflops']:14.1f}")
    for kind in order:
        picked = [r for r in rows_out if r["kind"] == kind]
        if picked:
            s, flop, first, hot = (sum(r[key] for r in picked) for key in ("step_s", "gflop", "first_s", "hot_s"))
            lines.append(f"{kind:13s} {'total':>6s} {sum(r['calls'] for r in picked):6d} {s:7.3f} {flop:7.1f} "
                         f"{flop / s:16.1f} {flop / first:14.1f} {flop / hot:14.1f}")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"dtype": args.dtype, "threads": torch.get_num_threads(), "warmup": args.warmup, "step_s": step_s,
             "groups": rows_out, "time": time.time()}, indent=2) + "\n")
        args.out.with_suffix(".txt").write_text(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
