"""`moetrain bench moe` of main (A) against this tree (B), alternating A B B A per dtype in one run.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_moe_ab.py --baseline /work/main [--candidate DIR]
        [--dtypes float32,bfloat16] [--json benchmarks/results/bench_moe_ab.json]

Each measurement is a fresh `python -m moetrain bench moe --preset qwen3_moe_debug --threads 1
--clock cpu --no-backend-comparison` of one tree (its own src on PYTHONPATH, its own bench code),
so the run compares what each tree's `bench moe` reports: the three implementations' fwd+bwd
CPU time and their fraction of the 1024^2 GEMM peak measured in the same process. A third
label, "A+reuse", runs main's layer under this tree's allocator setting (freed heap memory
reused, as `moetrain train` does) by calling `reuse_freed_host_memory(1)` before main's bench,
which separates the measurement change from any change of the layer. Benchmark only: nothing
asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
BENCH = ["--preset", "qwen3_moe_debug", "--threads", "1", "--clock", "cpu", "--no-backend-comparison"]
REUSE_THEN_BENCH = ("import sys; from moetrain.runtime.allocator import reuse_freed_host_memory; "
                    "reuse_freed_host_memory(1); from moetrain.bench.moe import main; sys.exit(main(sys.argv[1:]))")


def run_one(tree: Path, label: str, dtype: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        args = [*BENCH, "--dtype", dtype, "--json", str(out)]
        cmd = ([sys.executable, "-c", REUSE_THEN_BENCH, *args] if label == "A+reuse"
               else [sys.executable, "-m", "moetrain", "bench", "moe", *args])
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr[-2000:], file=sys.stderr)
            return {}
        report = json.loads(out.read_text())
    return {"label": label, "dtype": dtype, "loadavg": os.getloadavg()[0],
            "peak_gflops": report["gemm_peak_flops_per_s"] / 1e9,
            **{f"{r['impl']}_ms": r["fwd_bwd_ms"] for r in report["results"]},
            **{f"{r['impl']}_of_peak": r["fraction_of_gemm_peak"] for r in report["results"]}}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--candidate", default=str(HERE))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args(argv)
    trees = {"A": Path(opts.baseline).resolve(), "A+reuse": Path(opts.baseline).resolve(),
             "B": Path(opts.candidate).resolve()}
    rows = []
    for dtype in opts.dtypes.split(","):
        for label in ("A", "B", "A+reuse", "A+reuse", "B", "A"):
            row = run_one(trees[label], label, dtype)
            if not row:
                continue
            rows.append(row)
            print(f"{dtype:8s} {label:8s} peak {row['peak_gflops']:5.0f} GFLOP/s | " + " | ".join(
                f"{impl} {row[impl + '_ms']:6.1f} ms {100 * row[impl + '_of_peak']:4.1f}%"
                for impl in ("loop", "grouped", "memory_efficient")) + f" | load {row['loadavg']:.1f}", flush=True)
    summary = {}
    for dtype in opts.dtypes.split(","):
        for label in trees:
            pick = [r for r in rows if r["dtype"] == dtype and r["label"] == label]
            if pick:
                summary[f"{dtype}_{label}"] = {k: statistics.median(r[k] for r in pick)
                                               for k in pick[0] if k not in ("label", "dtype")}
                s = summary[f"{dtype}_{label}"]
                print(f"median {dtype:8s} {label:8s}: memory_efficient {s['memory_efficient_ms']:6.1f} ms "
                      f"{100 * s['memory_efficient_of_peak']:4.1f}% of peak, "
                      f"grouped {100 * s['grouped_of_peak']:4.1f}%, loop {100 * s['loop_of_peak']:4.1f}%")
    if opts.json:
        opts.json.write_text(json.dumps({"rows": rows, "summary": summary, "argv": sys.argv}, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
