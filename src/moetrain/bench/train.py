"""`moetrain bench train --config C [--section.field value ...] [--steps N] [--warmup N] [--json PATH]`.

Runs a short training job exactly as `moetrain train` builds it (same config parsing, data,
mesh, Trainer and step), on one process or under `torchrun` on any mesh, without a run
directory, checkpoints or evaluation. After `--warmup` steps it times `--steps` steps and
reports tokens/s (global, from the median step time of the slowest rank), the median step
split into the phases of `moetrain.observe.step_phases` (data, forward, backward, collectives,
wait, optimizer; mean over ranks of each rank's median), peak memory per rank (the RSS
high-water mark on CPU; max allocated and reserved on CUDA) and MFU against the peak
`Trainer.peak_flops_per_rank` takes the peak of the run's threads and dtype (a GEMM measured
while the cores are idle and cached, on CPU; the device's dense peak on CUDA) unless
`train.peak_flops` sets one.

It prints a table on rank 0 and writes the numbers as JSON (default
<logging.run_dir>/bench_train_<dtype>_w<world>.json, or --json PATH). This is a benchmark: it
asserts nothing about time, and it must not change how training runs.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from moetrain.args import check_output_path, take_option
from moetrain.config.job import CommandOption, JobConfig, parse_job_args
from moetrain.data.dataset import load_training_data
from moetrain.errors import ConfigError
from moetrain.logging import setup_logging
from moetrain.observe.step_phases import PHASES
from moetrain.parallel.collectives import all_gather_floats
from moetrain.parallel.process_group import distributed_job
from moetrain.runtime.allocator import reuse_freed_host_memory
from moetrain.runtime.threads import set_intra_op_threads
from moetrain.train.trainer import Trainer

PROG = "moetrain bench train"


def _count(value: str | None, name: str, default: int, minimum: int) -> int:
    if value is None:
        return default
    try:
        count = int(value)
    except ValueError:
        count = minimum - 1
    if not minimum <= count <= 1 << 40:  # more steps than any run takes: a mistyped value, not a benchmark
        raise ConfigError(f"--{name} = {value!r} is invalid: must be an integer in [{minimum}, 2**40]")
    return count


def peak_memory_bytes(device: torch.device) -> dict[str, float]:
    """This process's peak memory: RSS high-water mark on CPU; CUDA max allocated / reserved too."""
    # ru_maxrss is in KiB on Linux.
    memory = {"peak_rss_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}
    if device.type == "cuda":
        memory["cuda_max_allocated_bytes"] = float(torch.cuda.max_memory_allocated(device))
        memory["cuda_max_reserved_bytes"] = float(torch.cuda.max_memory_reserved(device))
    return memory


def measure(cfg: JobConfig, steps: int, warmup: int) -> dict[str, Any]:
    """Build the Trainer for `cfg`, take `warmup` + `steps` steps; every rank returns the same summary."""
    data = load_training_data(cfg)
    set_intra_op_threads(cfg.train.num_threads)  # as `moetrain train` does
    with distributed_job(cfg.parallel) as job:
        reuse_freed_host_memory(job.world, cfg.lora.enabled)  # as `moetrain train` does
        return _measure(Trainer(cfg, data, job), steps, warmup)


def _measure(trainer: Trainer, steps: int, warmup: int) -> dict[str, Any]:
    cfg, rank, world, device = trainer.cfg, trainer.rank, trainer.world, trainer.device
    timed = []
    for index in range(warmup + steps):
        result = trainer.train_step()
        if index >= warmup:
            timed.append(result)
    local = [value for r in timed for value in (r.step_s, *(r.phases[name] for name in PHASES))]
    memory = peak_memory_bytes(device)
    gathered = all_gather_floats(local + list(memory.values()))
    width = 1 + len(PHASES)
    per_rank_steps = [[row[i * width:(i + 1) * width] for i in range(steps)] for row in gathered]
    per_rank_memory = [dict(zip(memory, row[steps * width:], strict=True)) for row in gathered]
    # A step ends for everyone when its slowest rank is done.
    step_s = statistics.median(max(rank[i][0] for rank in per_rank_steps) for i in range(steps))
    phase_s = {name: statistics.mean(statistics.median(step[1 + j] for step in rank) for rank in per_rank_steps)
               for j, name in enumerate(PHASES)}
    tokens_per_s = trainer.tokens_per_rank_step * world / step_s
    peak_per_rank = trainer.peak_flops_per_rank()
    return {
        "rank": rank, "config": cfg.to_dict(), "world_size": world,
        "mesh": None if trainer.job.data is None else list(trainer.job.data.shape),
        "device": str(device), "threads_per_rank": torch.get_num_threads(), "param_dtype": cfg.parallel.param_dtype,
        "steps": steps, "warmup": warmup, "tokens_per_step": trainer.tokens_per_rank_step * world,
        "step_s_median": step_s, "tokens_per_s": tokens_per_s, "phases_s_median": phase_s,
        "step_s_per_rank": [[s[0] for s in rank] for rank in per_rank_steps],
        "flops_per_token": trainer.flops_per_token, "peak_flops_per_rank": peak_per_rank,
        "peak_flops_source": trainer.peak_flops_source,
        "mfu": trainer.flops_per_token * tokens_per_s / (peak_per_rank * world),
        "memory_per_rank": per_rank_memory, "losses": [r.loss for r in timed],
    }


def table(result: dict[str, Any]) -> str:
    mib = 2**20
    step = result["step_s_median"]
    rows = [f"{PROG}: {result['world_size']} rank(s), mesh {result['mesh']}, {result['param_dtype']}, "
            f"{result['threads_per_rank']} thread(s)/rank, {result['tokens_per_step']} tokens/step, "
            f"median of {result['steps']} steps after {result['warmup']}",
            f"  tokens/s          {result['tokens_per_s']:10.1f}",
            f"  step (median)     {step:10.3f} s"]
    for name, seconds in result["phases_s_median"].items():
        rows.append(f"    {name:15s} {seconds:10.3f} s  {100 * seconds / step:5.1f}%")
    rss = [m["peak_rss_bytes"] / mib for m in result["memory_per_rank"]]
    rows.append(f"  peak RSS / rank   {max(rss):10.1f} MiB (max; per rank {', '.join(f'{r:.0f}' for r in rss)})")
    if "cuda_max_allocated_bytes" in result["memory_per_rank"][0]:
        alloc = max(m["cuda_max_allocated_bytes"] for m in result["memory_per_rank"]) / mib
        reserved = max(m["cuda_max_reserved_bytes"] for m in result["memory_per_rank"]) / mib
        rows.append(f"  CUDA peak / rank  {alloc:10.1f} MiB allocated, {reserved:.1f} MiB reserved")
    rows.append(f"  MFU               {100 * result['mfu']:10.2f} %  (peak {result['peak_flops_per_rank'] / 1e9:.1f} "
                f"GFLOP/s per rank, {result['peak_flops_source']}; {result['flops_per_token'] / 1e6:.1f} "
                "MFLOP/token)")
    return "\n".join(rows)


OPTIONS = (
    CommandOption("steps", int, 5, "timed steps (after the warm-up)"),
    CommandOption("warmup", int, 2, "untimed steps first (compilation, allocator warm-up)"),
    CommandOption("json", str | None, None, "where the JSON result goes; None = bench_train_<dtype>_w<world>.json "
                  "in the job's logging.run_dir"),
)


def main(argv: list[str]) -> int:
    steps_arg, argv = take_option(argv, "steps")
    warmup_arg, argv = take_option(argv, "warmup")
    json_arg, argv = take_option(argv, "json")
    steps = _count(steps_arg, "steps", 5, 1)
    warmup = _count(warmup_arg, "warmup", 2, 0)
    cfg = parse_job_args(argv, prog=PROG, description=" ".join(__doc__.split("\n\n")[1].split()), options=OPTIONS)
    if json_arg:
        check_output_path(json_arg, "--json")
    setup_logging()
    result = measure(cfg, steps, warmup)
    if result["rank"] != 0:
        return 0
    print(table(result), flush=True)
    name = f"bench_train_{cfg.parallel.param_dtype}_w{result['world_size']}.json"
    path = Path(json_arg) if json_arg else Path(cfg.logging.run_dir) / name  # under the run, not the cwd
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "time": time.time(), "argv": ["moetrain", *sys.argv[1:]]}, indent=2) + "\n")
    print(f"json: {path}")
    return 0
