"""`moetrain bench train` of two trees side by side: one process at the issue's shape and four ranks.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/ab/bench_train_ab.py --baseline ../base --candidate . \
        --out benchmarks/results/bench_train_ab_NAME [--rounds 2] [--report-only]

Scenarios (qwen3_moe_debug):
  one process   vocabulary 2048, one microbatch of 2 x 512 tokens, 2 threads, `--one-warmup` (1)
                warm-up + `--one-steps` (3) timed steps; bfloat16 then float32; round r runs A then B
                (B then A in odd rounds), fresh processes.
  four ranks    `torchrun --standalone --nproc-per-node 4`, 2 microbatches of 1 x 128 tokens per rank,
                one thread per rank, 1 warm-up + 2 timed steps; float32 then bfloat16: A with FSDP 4,
                B with FSDP 4, B with FSDP 4 + EP 4 (one run each: a 4-rank run takes minutes here);
                `--skip-four-ranks` leaves them out.

Each run's own JSON (bench train's `--json`) goes to OUT/<scenario>_<label>_<dtype>_r<round>.json; the
report (also `--report-only`, from the JSON files already in OUT) prints a table, writes
OUT/table.md and OUT/summary.json and plots tokens/s per scenario to OUT/tokens_per_s.png.

bench train's MFU divides by a bf16/float32 GEMM peak it probes at the start of each run; on a
2-core machine that probe moves by up to 2x between runs, so the table also gives each run's MFU
against one fixed peak per dtype for the one-process runs (`--fixed-peak-bf16`, `--fixed-peak-fp32`,
GFLOP/s; default the highest one-process probe among the runs), which ranks them by tokens/s alone.
A benchmark: asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.ab import runner
from benchmarks.issue_shape import ARGS

ONE_PROCESS = [*ARGS, "--train.num_threads", "2"]
FOUR_RANKS = ["--config", "configs/qwen3_moe_debug.toml", "--data.seq_len", "128", "--data.max_documents", "300",
              "--train.microbatch_size", "1", "--train.grad_accum", "2", "--train.num_threads", "1", "--steps", "2",
              "--warmup", "1"]


def run(tree: runner.Tree, argv: list[str], out: Path, ranks: int) -> None:
    print(f"== {out.stem}", flush=True)
    report = runner.run(tree, ["-m", "moetrain", "bench", "train", *argv, "--json", "{json}"], ranks=ranks)
    out.write_text(json.dumps(report, indent=2) + "\n")


def measure(args: argparse.Namespace) -> None:
    trees = runner.two_trees(args.baseline, args.candidate)
    for dtype in ("bfloat16", "float32"):
        for round_, label in runner.alternate(["A", "B"], args.rounds):
            run(trees[label], [*ONE_PROCESS, "--steps", str(args.one_steps), "--warmup", str(args.one_warmup),
                               "--parallel.param_dtype", dtype],
                args.out / f"one_{label}_{dtype}_r{round_}.json", 1)
    if args.skip_four_ranks:
        return
    for dtype in ("float32", "bfloat16"):
        for label, tree, extra in (("A_fsdp4", trees["A"], []), ("B_fsdp4", trees["B"], []),
                                   ("B_ep4", trees["B"], ["--parallel.ep", "4"])):
            run(tree, [*FOUR_RANKS, "--parallel.param_dtype", dtype, *extra],
                args.out / f"four_{label}_{dtype}_r0.json", 4)


def report(args: argparse.Namespace) -> None:
    runs = []
    for path in sorted(args.out.glob("*.json")):
        if path.name == "summary.json":
            continue
        data = json.loads(path.read_text())
        scenario, *label_parts, dtype, _round = path.stem.split("_")
        label = "_".join(label_parts)
        runs.append({"file": path.name, "scenario": scenario, "label": label, "dtype": dtype,
                     "tokens_per_s": data["tokens_per_s"], "mfu_probe": data["mfu"],
                     "peak_probe_gflops": data["peak_flops_per_rank"] / 1e9,
                     "flops_per_token": data["flops_per_token"], "world": data["world_size"],
                     "peak_rss_mib": max(m["peak_rss_bytes"] for m in data["memory_per_rank"]) / 2**20})
    fixed = {"bfloat16": args.fixed_peak_bf16, "float32": args.fixed_peak_fp32}
    for dtype in fixed:
        if fixed[dtype] is None:
            fixed[dtype] = max((r["peak_probe_gflops"] for r in runs if r["dtype"] == dtype and r["world"] == 1),
                               default=1.0)
    rows = []
    keys = sorted({(r["scenario"], r["dtype"], r["label"]) for r in runs}, key=lambda k: (k[0] != "one", k[1], k[2]))
    for scenario, dtype, label in keys:
        picked = [r for r in runs if (r["scenario"], r["dtype"], r["label"]) == (scenario, dtype, label)]
        tps = [r["tokens_per_s"] for r in picked]
        world = picked[0]["world"]
        fixed_mfu = ([r["flops_per_token"] * r["tokens_per_s"] / (fixed[dtype] * 1e9) for r in picked]
                     if world == 1 else None)
        rows.append({"scenario": scenario, "dtype": dtype, "label": label, "runs": len(picked),
                     "tokens_per_s": tps, "tokens_per_s_median": statistics.median(tps),
                     "mfu_probe": [r["mfu_probe"] for r in picked], "mfu_fixed_peak": fixed_mfu,
                     "peak_rss_mib": [r["peak_rss_mib"] for r in picked]})
    lines = [f"| scenario | dtype | tree | runs | tokens/s | MFU (each run's own probe) | MFU (fixed peak: bf16 "
             f"{fixed['bfloat16']:.0f}, fp32 {fixed['float32']:.0f} GFLOP/s) | peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        fmt = lambda values, spec: " / ".join(format(v, spec) for v in values)  # noqa: E731
        fixed_cell = fmt([100 * v for v in row["mfu_fixed_peak"]], ".1f") + " %" if row["mfu_fixed_peak"] else "n/a"
        lines.append(f"| {row['scenario']} | {row['dtype']} | {row['label']} | {row['runs']} | "
                     f"{fmt(row['tokens_per_s'], '.1f')} | {fmt([100 * v for v in row['mfu_probe']], '.2f')} % | "
                     f"{fixed_cell} | {fmt(row['peak_rss_mib'], '.0f')} |")
    text = "\n".join(lines)
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "summary.json").write_text(json.dumps({"fixed_peak_gflops": fixed, "rows": rows}, indent=2) + "\n")
    short = {"bfloat16": "bf16", "float32": "fp32"}
    runner.plot([{"case": f"{r['scenario']} {short[r['dtype']]}", "label": r["label"],
                  "tokens_per_s": r["tokens_per_s_median"], "tokens_per_s_runs": r["tokens_per_s"]} for r in rows],
                "tokens_per_s", args.out / "tokens_per_s.png",
                "bench train, A (baseline) grey, B blue; qwen3_moe_debug")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="tree A (a checkout with src/ and configs/)")
    parser.add_argument("--candidate", default=str(runner.REPO), help="tree B (default: this one)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--one-steps", type=int, default=3, help="timed steps of a one-process run")
    parser.add_argument("--one-warmup", type=int, default=1, help="warm-up steps of a one-process run")
    parser.add_argument("--skip-four-ranks", action="store_true")
    parser.add_argument("--fixed-peak-bf16", type=float)
    parser.add_argument("--fixed-peak-fp32", type=float)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        if not args.baseline:
            parser.error("--baseline is required unless --report-only")
        measure(args)
    report(args)


if __name__ == "__main__":
    main(sys.argv[1:])
