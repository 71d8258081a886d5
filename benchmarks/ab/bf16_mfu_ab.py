"""bf16 (and float32) MFU of one process on qwen3_moe_debug, main (A) against this tree (B), alternating in one run.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/ab/bf16_mfu_ab.py driver --baseline ../base \
        [--rounds 2] [--threads 1,2] [--dtypes bfloat16,float32] [--json benchmarks/results/bf16_mfu_ab.json]

The issue's shape: vocabulary 2048, microbatches of 2 x 512 tokens (grad_accum 1), `bench train`'s
Trainer. Each measurement is a fresh process of one tree (A B B A ... so drift hits both alike):
one warm-up step, then `--steps` timed steps. It reports, per step, the wall time and the
process CPU time (user + system, all threads), and the 1024^2 GEMM peak taken in the same process
the same two ways (best of 8). MFU = model FLOPs per step / step time / peak. On a shared,
oversubscribed machine the wall-clock MFU depends on what else runs; the CPU-time MFU (FLOPs per
CPU-second of the step over FLOPs per CPU-second of the GEMM) does much less, so both are
reported, with the load average. Trees are run through `benchmarks/ab/runner.py`. Benchmark
only: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.ab import runner
from benchmarks.issue_shape import ARGS

MARKER = "MFU_RESULT "


def _cpu() -> float:
    return time.process_time()  # all threads, nanosecond clock (os.times() ticks at 10 ms)


def worker(argv: list[str]) -> None:
    import torch

    from moetrain.config.job import parse_job_args
    from moetrain.data.dataset import load_training_data
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed
    from moetrain.runtime.allocator import reuse_freed_host_memory
    from moetrain.runtime.threads import set_intra_op_threads
    from moetrain.train.trainer import Trainer

    steps = int(argv[0])
    cfg = parse_job_args(argv[1:])
    data = load_training_data(cfg)
    set_intra_op_threads(cfg.train.num_threads)
    _, world, device = init_distributed(cfg.parallel)
    reuse_freed_host_memory(world)
    trainer = Trainer(cfg, data, JobMesh.from_config(cfg.parallel, world, device))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.parallel.param_dtype]
    a, b = torch.randn(1024, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
    torch.mm(a, b)
    gemm_wall, gemm_cpu = float("inf"), float("inf")
    for _ in range(8):
        wall, cpu = time.perf_counter(), _cpu()
        torch.mm(a, b)
        gemm_wall, gemm_cpu = min(gemm_wall, time.perf_counter() - wall), min(gemm_cpu, _cpu() - cpu)
    trainer.train_step()
    walls, cpus, losses, phases = [], [], [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), _cpu()
        result = trainer.train_step()
        walls.append(time.perf_counter() - wall)
        cpus.append(_cpu() - cpu)
        losses.append(result.loss)
        phases.append(result.phases)
    flops = trainer.flops_per_token * trainer.tokens_per_rank_step
    gemm_flops = 2.0 * 1024**3
    step_wall, step_cpu = statistics.median(walls), statistics.median(cpus)
    print(MARKER + json.dumps({"step_wall_s": step_wall, "step_cpu_s": step_cpu, "losses": losses,
                      "phases_wall_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
                      "tokens_per_s": trainer.tokens_per_rank_step / step_wall,
                      "gemm_wall_flops": gemm_flops / gemm_wall, "gemm_cpu_flops": gemm_flops / max(gemm_cpu, 1e-9),
                      "mfu_wall": flops / step_wall / (gemm_flops / gemm_wall),
                      "mfu_cpu": flops / step_cpu / (gemm_flops / max(gemm_cpu, 1e-9)),
                      "flops_per_step": flops, "threads": torch.get_num_threads(),
                      "loadavg": os.getloadavg()[0]}), flush=True)


def driver(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="tree A: a checkout with src/")
    parser.add_argument("--candidate", default=str(runner.REPO), help="the B tree (default: this one); a snapshot "
                        "(git archive) keeps edits made while the run goes on out of it")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args(argv)
    trees = runner.two_trees(opts.baseline, opts.candidate)
    rows = []
    for round_ in range(opts.rounds):
        for threads in opts.threads.split(","):
            for dtype in opts.dtypes.split(","):
                for label in runner.order("AB", round_):
                    args = [*ARGS, "--train.num_threads", threads, "--parallel.param_dtype", dtype]
                    result = runner.run(trees[label], [str(Path(__file__).resolve()), "worker", str(opts.steps),
                                                       *args], marker=MARKER)
                    row = {"tree": label, "round": round_, "dtype": dtype, **result}
                    rows.append(row)
                    print(f"round {round_} {label} {dtype:8s} {threads} thr: step {row['step_wall_s']:6.2f} s wall "
                          f"{row['step_cpu_s']:6.2f} s cpu | MFU wall {100 * row['mfu_wall']:5.1f}% "
                          f"cpu {100 * row['mfu_cpu']:5.1f}% | peak wall {row['gemm_wall_flops'] / 1e9:5.0f} "
                          f"cpu {row['gemm_cpu_flops'] / 1e9:5.0f} GFLOP/s | load {row['loadavg']:.1f} "
                          f"| loss {row['losses'][0]:.4f} | phases wall "
                          + " ".join(f"{k} {v:.2f}" for k, v in row["phases_wall_s"].items() if v > 0.005), flush=True)
    summary = {}
    for threads in opts.threads.split(","):
        for dtype in opts.dtypes.split(","):
            pick = {t: [r for r in rows if r["tree"] == t and r["dtype"] == dtype and r["threads"] == int(threads)]
                    for t in "AB"}
            if not (pick["A"] and pick["B"]):
                continue
            med = {t: {k: statistics.median(r[k] for r in pick[t]) for k in ("step_wall_s", "step_cpu_s", "mfu_wall",
                                                                             "mfu_cpu")} for t in "AB"}
            key = f"{dtype}_{threads}threads"
            summary[key] = {**{f"{t}_{k}": v for t in "AB" for k, v in med[t].items()},
                            "speedup_wall": med["A"]["step_wall_s"] / med["B"]["step_wall_s"],
                            "speedup_cpu": med["A"]["step_cpu_s"] / med["B"]["step_cpu_s"]}
            s = summary[key]
            print(f"{key}: A MFU wall {100 * s['A_mfu_wall']:.1f}% cpu {100 * s['A_mfu_cpu']:.1f}% | B MFU wall "
                  f"{100 * s['B_mfu_wall']:.1f}% cpu {100 * s['B_mfu_cpu']:.1f}% | B/A speed wall "
                  f"{s['speedup_wall']:.2f}x cpu {s['speedup_cpu']:.2f}x")
    if opts.json:
        opts.json.write_text(json.dumps({"rows": rows, "summary": summary, "argv": sys.argv}, indent=2) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
    else:
        driver(sys.argv[2:] if sys.argv[1:2] == ["driver"] else sys.argv[1:])
