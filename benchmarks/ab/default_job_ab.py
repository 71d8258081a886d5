"""The default job, side by side: a baseline checkout (A) against this tree (B), each with its own config.

Each tree runs `moetrain train --config configs/tiny_moe.toml` from its own checkout with its own
.venv (so each uses its own default-job settings, threads included) for `--steps` steps without
evaluation, checkpoints or sample, as fresh processes alternating A B B A ... (through
`benchmarks/ab/runner.py`); the time is the run's own training-loop time (the final record's
`wall_s`). Losses are printed so that a change in what is computed shows.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/ab/default_job_ab.py \
        --baseline ../base --steps 60 --rounds 2 --out benchmarks/results/default_job_ab

Benchmark only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from benchmarks.ab import runner


def read_run(tmp: Path, done: subprocess.CompletedProcess) -> dict:
    """The final record's loop time, the last training loss and the thread count the run logged."""
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    final = next(r for r in records if r["kind"] == "final")
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    threads = [line for line in done.stderr.splitlines() if "intra-op threads" in line]
    return {"wall_s": final["wall_s"], "last_loss": losses[-1], "threads": threads[0].split("INFO ")[-1] if threads else
            "(not logged: the tree's own train.num_threads)"}


def run_one(tree: runner.Tree, steps: int) -> dict:
    command = ["-m", "moetrain", "train", "--config", str(tree.path / "configs" / "tiny_moe.toml"),
               "--train.steps", str(steps), "--train.eval_every", "0", "--train.sample_tokens", "0",
               "--checkpoint.enabled", "False", "--logging.progress_bar", "False", "--logging.run_dir", "{tmp}/run"]
    env = {k: v for k, v in tree.env().items() if k != "OMP_NUM_THREADS"}
    return runner.run(tree, command, env=env, read=read_run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="tree A: a checkout with src/, configs/ and .venv/")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=runner.RESULTS / "default_job_ab")
    args = parser.parse_args()
    trees = runner.two_trees(args.baseline, python_from_tree=True)
    results: dict[str, list[dict]] = {"A": [], "B": []}
    for _, label in runner.alternate(["A", "B"], args.rounds):
        result = run_one(trees[label], args.steps)
        results[label].append(result)
        print(f"{label} wall_s {result['wall_s']:.1f} steps {args.steps} last loss {result['last_loss']:.4f} "
              f"threads: {result['threads']}", flush=True)
    a = statistics.mean(r["wall_s"] for r in results["A"])
    b = statistics.mean(r["wall_s"] for r in results["B"])
    print(f"B / A speed: {a / b:.2f}x (mean loop time A {a:.1f} s, B {b:.1f} s)")
    runner.save(args.out, {"baseline": runner.revision(trees["A"]), "steps": args.steps, "rounds": args.rounds,
                           "results": results, "speedup": a / b})


if __name__ == "__main__":
    main()
