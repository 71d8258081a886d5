"""The default job's step and evaluation in process CPU time, in float32 or bf16, optionally by op kind.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/profile/default_job_step_cpu.py [--dtype bfloat16] [--threads 1]
        [--steps 6] [--profile] [--section.field value ...]

Builds the Trainer of `configs/tiny_moe.toml` (checkpoints off), takes 3 warm-up steps, then times `--steps`
steps and one held-out evaluation by wall clock and by `time.process_time` (user + system of the whole
process: on a shared machine it moves much less with the load than the wall clock, though cache contention
still inflates it). `--profile` adds torch.profiler's self time per op kind over the same number of steps
(wall-based, so its shares, not its seconds, are what to read on a loaded machine). Run the dtypes as
fresh processes side by side (A B B A) and compare ratios. A benchmark; it asserts nothing.
"""

from __future__ import annotations

import collections
import sys
import time

from benchmarks.profile.bf16_step_profile import kind_of, trainer_from_args
from torch.profiler import ProfilerActivity, profile

from moetrain.args import take_option
from moetrain.train.trainer import Trainer


def default_job_trainer(dtype: str, threads: int, overrides: list[str]) -> Trainer:
    argv = ["--config", "configs/tiny_moe.toml", "--train.num_threads", str(threads), "--parallel.param_dtype",
            dtype, "--checkpoint.enabled", "False", *overrides]
    return trainer_from_args(argv, "default-job trainer")


def print_op_kinds(trainer: Trainer, steps: int) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            trainer.train_step()
    by_kind: dict[str, float] = collections.defaultdict(float)
    rows = []
    for evt in prof.key_averages():
        if evt.key.startswith("aten::"):
            seconds = evt.self_cpu_time_total / 1e6 / steps
            by_kind[kind_of(evt.key)] += seconds
            rows.append((seconds, evt.key, evt.count // steps))
    total = sum(by_kind.values())
    print(f"aten self time {total:.3f} s/step under the profiler")
    for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:22s} {seconds:8.3f} s  {100 * seconds / total:5.1f}%")
    for seconds, key, count in sorted(rows, reverse=True)[:20]:
        print(f"  {key:40s} {seconds:8.4f} s  {count:6d} calls/step")


def main(argv: list[str]) -> None:
    dtype, argv = take_option(argv, "dtype")
    threads, argv = take_option(argv, "threads")
    steps_arg, argv = take_option(argv, "steps")
    with_profile = "--profile" in argv
    argv = [a for a in argv if a != "--profile"]
    steps = int(steps_arg or 6)
    trainer = default_job_trainer(dtype or "float32", int(threads or 1), argv)
    for _ in range(3):
        trainer.train_step()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        trainer.train_step()
    step_wall, step_cpu = (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.evaluate()
    eval_wall, eval_cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{trainer.cfg.parallel.param_dtype}, {trainer.cfg.train.num_threads} thread(s): step wall {step_wall:.3f} s "
          f"cpu {step_cpu:.3f} s; one evaluation wall {eval_wall:.2f} s cpu {eval_cpu:.2f} s", flush=True)
    if with_profile:
        print_op_kinds(trainer, steps)


if __name__ == "__main__":
    main(sys.argv[1:])
