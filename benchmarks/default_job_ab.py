"""The default job, side by side: a baseline checkout (A) against this tree (B), each with its own config.

Each tree runs `moetrain train --config configs/tiny_moe.toml` from its own checkout (so each uses
its own default-job settings, threads included) for `--steps` steps without evaluation, checkpoints
or sample, as fresh processes alternating A B B A ...; the time is the run's own training-loop time
(the final record's `wall_s`). Losses are printed so that a change in what is computed shows.

    flock /tmp/moetrain-heavy.lock .venv/bin/python benchmarks/default_job_ab.py \
        --baseline /work/wt/baseline --steps 60 --rounds 2 --out benchmarks/results/default_job_ab

Benchmark only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def run_one(tree: Path, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        command = [str(tree / ".venv" / "bin" / "python"), "-m", "moetrain", "train",
                   "--config", str(tree / "configs" / "tiny_moe.toml"), "--train.steps", str(steps),
                   "--train.eval_every", "0", "--train.sample_tokens", "0", "--checkpoint.enabled", "False",
                   "--logging.progress_bar", "False", "--logging.run_dir", str(Path(tmp) / "run")]
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        env["PYTHONPATH"] = str(tree / "src")
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"{tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    final = next(r for r in records if r["kind"] == "final")
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    threads = [line for line in done.stderr.splitlines() if "intra-op threads" in line]
    return {"wall_s": final["wall_s"], "last_loss": losses[-1], "threads": threads[0].split("INFO ")[-1] if threads else
            "(not logged: the tree's own train.num_threads)"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/default_job_ab")
    args = parser.parse_args()
    trees = {"A": Path(args.baseline).resolve(), "B": HERE}
    results: dict[str, list[dict]] = {"A": [], "B": []}
    for round_ in range(args.rounds):
        for label in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
            result = run_one(trees[label], args.steps)
            results[label].append(result)
            print(f"{label} wall_s {result['wall_s']:.1f} steps {args.steps} last loss {result['last_loss']:.4f} "
                  f"threads: {result['threads']}", flush=True)
    a = statistics.mean(r["wall_s"] for r in results["A"])
    b = statistics.mean(r["wall_s"] for r in results["B"])
    print(f"B / A speed: {a / b:.2f}x (mean loop time A {a:.1f} s, B {b:.1f} s)")
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"baseline": str(trees["A"]), "steps": args.steps, "rounds": args.rounds,
                               "time": time.time(), "results": results, "speedup": a / b}, indent=2) + "\n")


if __name__ == "__main__":
    main()
