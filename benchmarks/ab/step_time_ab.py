"""Step time, side by side: today's main (A) against this tree (B), alternating, in one run.

`driver` runs every scenario as fresh processes, A and B alternating (A B B A ... so drift hits
both alike), each tree with its own interpreter and sources; `worker` is what each process runs:
it builds the job exactly as `moetrain train` does (config, data, process group, mesh, Trainer,
and, where the tree has it, the host-memory setting `moetrain train` applies), takes warm-up
steps, then times steps and prints one JSON line on rank 0: median step time of the slowest
rank, tokens/s, losses, peak RSS per rank. Multi-rank scenarios run under torchrun. Trees are
run through `benchmarks/ab/runner.py`, each with its own .venv.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/ab/step_time_ab.py driver \
        --baseline ../base --out benchmarks/results/step_time_ab

Benchmark only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from benchmarks.ab import runner

MARKER = "AB_RESULT "
CONFIG = "configs/qwen3_moe_debug.toml"
# Short rows and few documents keep one measurement at about a minute on 2 busy cores.
COMMON = ["--data.seq_len", "128", "--data.max_documents", "300", "--train.microbatch_size", "1",
          "--train.grad_accum", "2"]
SCENARIOS = {
    "1 process, float32": dict(ranks=1, args=["--train.num_threads", "2"]),
    "1 process, bfloat16": dict(ranks=1, args=["--train.num_threads", "2", "--parallel.param_dtype", "bfloat16"]),
    "4 ranks FSDP 4, float32": dict(ranks=4, args=["--train.num_threads", "1", "--parallel.dp_shard", "4"]),
    "4 ranks HSDP 2x2, float32": dict(ranks=4, args=["--train.num_threads", "1", "--parallel.dp_replicate", "2",
                                                      "--parallel.dp_shard", "2"]),
}


def worker(argv: list[str]) -> None:
    try:  # what `moetrain`'s entry point does before torch loads, in the tree that has it
        from moetrain.runtime.allocator import huge_pages_for_large_tensors
        huge_pages_for_large_tensors()
    except ImportError:
        pass
    import torch
    import torch.distributed as dist

    from moetrain.config.job import parse_job_args
    from moetrain.data.dataset import load_training_data
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed
    from moetrain.train.trainer import Trainer

    steps, warmup = int(argv[0]), int(argv[1])
    cfg = parse_job_args(argv[2:])
    data = load_training_data(cfg)
    torch.set_num_threads(cfg.train.num_threads)
    rank, world, device = init_distributed(cfg.parallel)
    try:  # what `moetrain train` does in the tree that has it
        from moetrain.runtime.allocator import reuse_freed_host_memory
        reuse_freed_host_memory(world)
    except ImportError:
        pass
    mesh = JobMesh.from_config(cfg.parallel, world, device)
    trainer = Trainer(cfg, data, mesh)
    results = [trainer.train_step() for _ in range(warmup + steps)][warmup:]
    mine = {"step_s": [r.step_s for r in results], "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    every = [None] * world
    dist.all_gather_object(every, mine)
    dist.barrier()
    if rank == 0:
        step_s = statistics.median(max(r["step_s"][i] for r in every) for i in range(steps))
        tokens = cfg.train.microbatch_size * cfg.train.grad_accum * cfg.data.seq_len * world
        print(MARKER + json.dumps({"step_s": step_s, "tokens_per_s": tokens / step_s,
                                          "losses": [r.loss for r in results],
                                          "peak_rss_mib_per_rank": [r["rss"] / 2**20 for r in every]}), flush=True)
    dist.destroy_process_group()


def run_one(tree: runner.Tree, scenario: dict, steps: int, warmup: int) -> dict:
    job = ["--config", str(runner.REPO / CONFIG), *COMMON, *scenario["args"], "--logging.progress_bar", "False"]
    start = time.time()
    result = runner.run(tree, [str(Path(__file__).resolve()), "worker", str(steps), str(warmup), *job],
                        ranks=scenario["ranks"], marker=MARKER, env=tree.env(OMP_NUM_THREADS="1"), timeout=1800)
    return {**result, "wall_s": time.time() - start}


def driver(args: argparse.Namespace) -> None:
    trees = runner.two_trees(args.baseline, python_from_tree=True, labels=("A (main)", "B (this tree)"))
    results: dict[str, dict[str, list[dict]]] = {}
    for name, scenario in SCENARIOS.items():
        if args.only and not any(o in name for o in args.only):
            continue
        results[name] = {label: [] for label in trees}
        rounds = args.rounds if scenario["ranks"] == 1 else args.multi_rank_rounds
        for _, label in runner.alternate(list(trees), rounds):
            result = run_one(trees[label], scenario, args.steps, args.warmup)
            results[name][label].append(result)
            print(f"{name} | {label} | {result['tokens_per_s']:.1f} tok/s | step {result['step_s']:.2f} s | "
                  f"RSS/rank max {max(result['peak_rss_mib_per_rank']):.0f} MiB", flush=True)
        save(args, results)


def save(args: argparse.Namespace, results: dict) -> None:
    rows = ["| scenario | A (main) tokens/s | B tokens/s | B / A | A peak RSS/rank MiB | B peak RSS/rank MiB |",
            "|---|---|---|---|---|---|"]
    for name, by_label in results.items():
        a, b = by_label["A (main)"], by_label["B (this tree)"]
        if not a or not b:
            continue
        a_tps = statistics.median(r["tokens_per_s"] for r in a)
        b_tps = statistics.median(r["tokens_per_s"] for r in b)
        a_rss = max(max(r["peak_rss_mib_per_rank"]) for r in a)
        b_rss = max(max(r["peak_rss_mib_per_rank"]) for r in b)
        rows.append(f"| {name} | {a_tps:.1f} | {b_tps:.1f} | {b_tps / a_tps:.2f}x | {a_rss:.0f} | {b_rss:.0f} |")
    out = Path(args.out)
    meta = {"config": CONFIG, "common_overrides": COMMON, "scenarios": SCENARIOS, "steps": args.steps,
            "warmup": args.warmup, "rounds": args.rounds,
            "multi_rank_rounds": args.multi_rank_rounds}
    runner.save(out, {"meta": meta, "results": results}, "\n".join(rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
    else:
        parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        parser.add_argument("mode", choices=["driver"])
        parser.add_argument("--baseline", required=True, help="tree A: a checkout with src/ and .venv/")
        parser.add_argument("--out", default=str(runner.RESULTS / "step_time_ab"))
        parser.add_argument("--steps", type=int, default=3)
        parser.add_argument("--warmup", type=int, default=1)
        parser.add_argument("--rounds", type=int, default=2)
        parser.add_argument("--multi-rank-rounds", type=int, default=1)
        parser.add_argument("--only", nargs="*")
        driver(parser.parse_args())
