"""Held-out bits per byte of the default job trained in float8 against bf16 (train.float8).

Each row is `configs/tiny_moe.toml` with `parallel.param_dtype = "bfloat16"` (the compute dtype float8
training replaces; master weights stay float32), run as a fresh subprocess with one intra-op thread,
no checkpoints and no sample, the quality grid's schedule (benchmarks/quality/grid.py), on one seed;
the rows run side by side. The question is quality, not speed: on CPU float8 runs in torchao's emulation
(moetrain.parallel.float8.NATIVE_ON), so only the held-out bpb and its relative gap to bf16 are the result.
A float8 row runs the attention, dense and shared-expert linears in the row's recipe and the routed experts'
grouped GEMMs in torchao's rowwise grouped recipe (what train.float8 converts: docs/design/float8.md).

    PYTHONPATH=src:. .venv/bin/python benchmarks/quality/float8_bpb.py --steps 300 --seq-len 128 --out float8_bpb

`--seq-len` shortens the sequences (the default job's 512 made an emulated float8 step take about 30 s on
a machine shared with other jobs). Benchmark only: nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.quality.grid import Row, read_records, run_one, schedule_args

ROOT = Path(__file__).resolve().parents[2]
BF16 = ("--parallel.param_dtype", "bfloat16")


def rows(recipes: list[str], control: bool = False) -> list[Row]:
    out = [Row("bf16", "float8", "bf16 compute (float32 master weights)", BF16)]
    out += [Row(f"float8_{r}", "float8", f"float8 {r} linears, float8 rowwise routed experts, bf16 elsewhere",
                (*BF16, "--train.float8", r)) for r in recipes]
    if control:  # the same function in bf16 with other rounding: how far rounding alone moves the 300-step number
        out.append(Row("bf16_segment_attention", "float8", "bf16, attention per document segment (a rounding control)",
                       (*BF16, "--model.attention", "segments")))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512, help="data.seq_len (the default job's: 512)")
    parser.add_argument("--recipes", nargs="*", default=["rowwise", "tensorwise"], choices=["tensorwise", "rowwise"])
    parser.add_argument("--control", action="store_true", help="add a bf16 row that differs from bf16 in rounding only")
    parser.add_argument("--out", default="float8_bpb", help="folder under benchmarks/results")
    args = parser.parse_args(argv)
    out = Path(os.path.relpath(ROOT / "benchmarks" / "results" / args.out))  # recorded in configs: no machine paths
    out.mkdir(parents=True, exist_ok=True)
    chosen = rows(args.recipes, args.control)

    def run(row: Row) -> str:
        extra = [*schedule_args(row, args.steps, args.eval_every, args.eval_batches, args.seed, quick=False),
                 "--data.seq_len", str(args.seq_len)]
        return run_one(row, args.seed, args.steps, extra, out / row.name, sys.executable)

    with ThreadPoolExecutor(max_workers=len(chosen)) as pool:  # side by side: one shared machine, equal load
        for message in pool.map(run, chosen):
            print(message, flush=True)
    summary = {"steps": args.steps, "seed": args.seed, "seq_len": args.seq_len, "rows": {}}
    for row in chosen:
        records = read_records(out / row.name / "metrics.jsonl")
        final = next((r for r in records if r.get("kind") == "final"), None)
        if final is None:
            continue
        train = [r for r in records if r.get("kind") == "train"]
        summary["rows"][row.name] = {"label": row.label, "heldout_bpb": final["heldout_bpb"],
                                     "wall_s": final["wall_s"], "last_loss_avg": train[-1]["loss_avg"] if train
                                     else None}
    base = summary["rows"].get("bf16")
    for name, entry in summary["rows"].items():
        if base is not None:
            entry["relative_to_bf16"] = entry["heldout_bpb"] / base["heldout_bpb"] - 1
        print(f"{name:20s} held-out bpb {entry['heldout_bpb']:.4f}  "
              f"({entry.get('relative_to_bf16', 0.0):+.2%} vs bf16)  wall {entry['wall_s']:.0f} s")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
