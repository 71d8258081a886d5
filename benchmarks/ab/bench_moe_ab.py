"""`moetrain bench moe` of a baseline tree (A) against this tree (B), alternating A B B A per dtype in one run.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/ab/bench_moe_ab.py --baseline ../base [--candidate DIR]
        [--dtypes float32,bfloat16] [--out benchmarks/results/bench_moe_ab]

Each measurement is a fresh `python -m moetrain bench moe --preset qwen3_moe_debug --threads 1
--clock cpu --no-backend-comparison` of one tree (its own src on PYTHONPATH, its own bench code),
so the run compares what each tree's `bench moe` reports: the three implementations' fwd+bwd
CPU time and their fraction of the 1024^2 GEMM peak measured in the same process. A third
label, "A+reuse", runs the baseline's layer under this tree's allocator setting (freed heap memory
reused, as `moetrain train` does) by calling `reuse_freed_host_memory(1)` before its bench,
which separates the measurement change from any change of the layer. Trees are run through
`benchmarks/ab/runner.py`. Benchmark only: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.ab import runner

BENCH = ["--preset", "qwen3_moe_debug", "--threads", "1", "--clock", "cpu", "--no-backend-comparison",
         "--json", "{json}"]
REUSE_THEN_BENCH = ("import sys; from moetrain.runtime.allocator import reuse_freed_host_memory; "
                    "reuse_freed_host_memory(1); from moetrain.bench.moe import main; sys.exit(main(sys.argv[1:]))")
IMPLS = ("loop", "grouped", "memory_efficient")
METRICS = ("peak_gflops", *(f"{impl}_ms" for impl in IMPLS), *(f"{impl}_of_peak" for impl in IMPLS))


def measure(tree: runner.Tree, dtype: str) -> dict:
    argv = ["-c", REUSE_THEN_BENCH] if tree.label == "A+reuse" else ["-m", "moetrain", "bench", "moe"]
    report = runner.run(tree, [*argv, *BENCH, "--dtype", dtype])
    return {"peak_gflops": report["gemm_peak_flops_per_s"] / 1e9,
            **{f"{r['impl']}_ms": r["fwd_bwd_ms"] for r in report["results"]},
            **{f"{r['impl']}_of_peak": r["fraction_of_gemm_peak"] for r in report["results"]}}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="tree A: a checkout with src/")
    parser.add_argument("--candidate", default=str(runner.REPO), help="tree B (default: this checkout)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", type=Path, default=runner.RESULTS / "bench_moe_ab")
    opts = parser.parse_args(argv)
    trees = runner.two_trees(opts.baseline, opts.candidate)
    trees["A+reuse"] = runner.Tree("A+reuse", trees["A"].path)
    rows = []
    for dtype in opts.dtypes.split(","):
        for _, label in runner.alternate(["A", "B", "A+reuse"], 2):
            row = {"case": dtype, "label": label, **measure(trees[label], dtype)}
            rows.append(row)
            print(f"{dtype:8s} {label:8s} peak {row['peak_gflops']:5.0f} GFLOP/s | " + " | ".join(
                f"{impl} {row[impl + '_ms']:6.1f} ms {100 * row[impl + '_of_peak']:4.1f}%" for impl in IMPLS),
                flush=True)
    summary = runner.medians(rows, METRICS)
    text = runner.table(summary, METRICS)
    print(text)
    runner.save(opts.out, {"trees": {k: runner.revision(t) for k, t in trees.items()}, "rows": rows,
                           "summary": summary}, text)
    runner.plot(summary, "memory_efficient_of_peak", opts.out.with_suffix(".png"))


if __name__ == "__main__":
    main(sys.argv[1:])
