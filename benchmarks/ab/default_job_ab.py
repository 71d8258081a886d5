"""The default job, side by side: a baseline checkout (A) against this tree (B), each with its own config.

Each tree runs `moetrain train --config configs/tiny_moe.toml` from its own checkout with its own
.venv (so each uses its own default-job settings, threads included) as fresh processes alternating
A B B A ... (through `benchmarks/ab/runner.py`). Two modes:

- loop (default): `--steps` steps without evaluation, checkpoints or sample; the time is the run's own
  training-loop time (the final record's `wall_s`).
- `--whole-job`: the tree's job as `make train` runs it (its own evaluation cadence, checkpoints and
  end-of-run sample; `--steps 0` keeps the config's step count), timed from process start to exit, which
  is what a user waits for; also the process's CPU time (user + system, load-independent up to cache
  effects), the loop's time and the final held-out bits/byte, so a change in what is computed shows.

`--seed S` and `--threads N` pass `--train.seed` / `--train.num_threads` to both trees (a busy machine's
start-up probe may pick one thread in one run and two in another: fix it to compare bits/byte).

    PYTHONPATH=$PWD/src:$PWD python benchmarks/ab/default_job_ab.py \
        --baseline ../base --steps 60 --rounds 2 --out benchmarks/results/default_job_ab
    PYTHONPATH=$PWD/src:$PWD python benchmarks/ab/default_job_ab.py \
        --baseline ../base --whole-job --rounds 2 --out benchmarks/results/default_job_whole_ab

Benchmark only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.ab import runner


def read_run(tmp: Path, done: subprocess.CompletedProcess) -> dict:
    """The final record's loop time, held-out bits/byte, the last training loss and the logged thread count."""
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    final = next(r for r in records if r["kind"] == "final")
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    threads = [line for line in done.stderr.splitlines() if "intra-op threads" in line]
    return {"wall_s": final["wall_s"], "last_loss": losses[-1], "heldout_bpb": final.get("heldout_bpb"),
            "evals": sum(r["kind"] == "eval" for r in records),
            "threads": threads[0].split("INFO ")[-1] if threads else "(not logged: the tree's own train.num_threads)"}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_one(tree: runner.Tree, steps: int, whole_job: bool, extra: list[str]) -> dict:
    command = ["-m", "moetrain", "train", "--config", str(tree.path / "configs" / "tiny_moe.toml"),
               "--logging.progress_bar", "False", "--logging.run_dir", "{tmp}/run", *extra]
    if steps:
        command += ["--train.steps", str(steps)]
    if not whole_job:
        command += ["--train.eval_every", "0", "--train.sample_tokens", "0", "--checkpoint.enabled", "False"]
    env = {k: v for k, v in tree.env().items() if k != "OMP_NUM_THREADS"}
    cpu_before, start = children_cpu_s(), time.perf_counter()
    result = runner.run(tree, command, env=env, read=read_run)
    return {**result, "process_s": time.perf_counter() - start, "cpu_s": children_cpu_s() - cpu_before,
            "loadavg": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="tree A: a checkout with src/, configs/ and .venv/")
    parser.add_argument("--steps", type=int, default=None, help="default: 60 in loop mode, the config's with "
                        "--whole-job")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--whole-job", action="store_true", help="the job as `make train` runs it, timed end to end")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=runner.RESULTS / "default_job_ab")
    args = parser.parse_args()
    steps = args.steps if args.steps is not None else (0 if args.whole_job else 60)
    extra = [*(["--train.seed", str(args.seed)] if args.seed is not None else []),
             *(["--train.num_threads", str(args.threads)] if args.threads is not None else [])]
    trees = runner.two_trees(args.baseline, python_from_tree=True)
    results: dict[str, list[dict]] = {"A": [], "B": []}
    for _, label in runner.alternate(["A", "B"], args.rounds):
        result = run_one(trees[label], steps, args.whole_job, extra)
        results[label].append(result)
        bpb = "" if result["heldout_bpb"] is None else f" held-out {result['heldout_bpb']:.4f} bits/byte"
        print(f"{label} process {result['process_s']:.1f} s cpu {result['cpu_s']:.1f} s loop {result['wall_s']:.1f} s "
              f"evals {result['evals']} last loss {result['last_loss']:.4f}{bpb} load {result['loadavg']:.1f} "
              f"threads: {result['threads']}", flush=True)
    key = "process_s" if args.whole_job else "wall_s"
    summary = {}
    for name in (key, "cpu_s"):
        a = statistics.mean(r[name] for r in results["A"])
        b = statistics.mean(r[name] for r in results["B"])
        summary[name] = {"A": a, "B": b, "B_over_A": b / a}
        print(f"{name}: mean A {a:.1f} s, B {b:.1f} s, B / A {b / a:.3f}")
    runner.save(args.out, {"baseline": runner.revision(trees["A"]), "candidate": runner.revision(trees["B"]),
                           "steps": steps, "whole_job": args.whole_job, "rounds": args.rounds, "extra": extra,
                           "results": results, "summary": summary})


if __name__ == "__main__":
    main()
