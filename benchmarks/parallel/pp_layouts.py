"""Step time and peak memory per rank of PP 2 x FSDP 2 against FSDP 4 and EP 4: one model, one global batch, 4 ranks.

Each layout is a fresh `torchrun` job of `moetrain bench train` (its median timed step, its peak RSS per
rank); the layouts alternate round by round so drift on a shared machine hits them alike. The global
batch is the same for all: 4 data ranks x `--accum` microbatches, or 2 data ranks x 2 `--accum` under PP.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/parallel/pp_layouts.py --rounds 2 \
        --out benchmarks/results/pp_layouts.json

Benchmark only: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def layouts(accum: int) -> dict[str, list[str]]:
    return {"fsdp4": ["--train.grad_accum", str(accum)],
            "ep4": ["--train.grad_accum", str(accum), "--parallel.ep", "4"],
            "pp2_fsdp2": ["--train.grad_accum", str(2 * accum), "--parallel.pp", "2"]}


def run(args: list[str], config: str, steps: int) -> dict:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        command = [torchrun, "--standalone", "--nproc-per-node", "4", "-m", "moetrain", "bench", "train",
                   "--config", config, "--steps", str(steps), "--warmup", "1", "--json", str(out), *args]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
        subprocess.run(command, check=True, cwd=REPO, env=env, capture_output=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny_moe.toml")
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--extra", default="--data.seq_len 256 --train.microbatch_size 2",
                        help="overrides every layout gets")
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in layouts(opts.accum)}
    for round_ in range(opts.rounds):
        names = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
        for name in names:
            result = run(layouts(opts.accum)[name] + opts.extra.split(), opts.config, opts.steps)
            runs[name].append({"step_s": result["step_s_median"], "tokens_per_s": result["tokens_per_s"],
                               "peak_rss_mib": max(m["peak_rss_bytes"] for m in result["memory_per_rank"]) / 2**20,
                               "tokens_per_step": result["tokens_per_step"]})
            print(name, runs[name][-1], flush=True)
    summary = {name: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for name, rows in runs.items()}
    for name, row in summary.items():
        print(f"{name:10s} step {row['step_s']:.2f} s  {row['tokens_per_s']:.0f} tok/s  peak RSS/rank "
              f"{row['peak_rss_mib']:.0f} MiB  ({row['tokens_per_step']:.0f} tokens/step)")
    if opts.out:
        opts.out.write_text(json.dumps({"runs": runs, "medians": summary}, indent=1))


if __name__ == "__main__":
    main()
