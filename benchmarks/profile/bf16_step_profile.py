"""Where one `bench train` step's time goes, by op kind: GEMMs, elementwise, casts, attention, gather/scatter.

    PYTHONPATH=src .venv/bin/python benchmarks/profile/bf16_step_profile.py [--dtype bfloat16] [--threads 2]
        [--steps 1] [--out benchmarks/results/bf16_step_profile.txt]

Builds the Trainer exactly as `moetrain bench train` does for qwen3_moe_debug at the issue's shape
(vocabulary 2048, microbatches of 2 x 512 tokens, grad_accum 1), takes one warm-up step, then
profiles `--steps` steps with torch.profiler (CPU, self time per aten op) and groups the ops
into kinds. Prints the kinds' share of the profiled self time and the top ops. A benchmark; it
asserts nothing.
"""

from __future__ import annotations

import collections
import sys
import time

import torch
from benchmarks.issue_shape import ARGS
from torch.profiler import ProfilerActivity, profile

from moetrain.args import take_option
from moetrain.config.job import parse_job_args
from moetrain.data.dataset import load_training_data
from moetrain.parallel.mesh import JobMesh
from moetrain.parallel.process_group import init_distributed
from moetrain.runtime.allocator import reuse_freed_host_memory
from moetrain.runtime.threads import set_intra_op_threads
from moetrain.train.trainer import Trainer

KINDS = (
    ("gemm", ("mm", "addmm", "bmm", "matmul", "linear", "_grouped_mm", "baddbmm", "addmm_")),
    ("attention", ("scaled_dot_product", "_flash_attention", "_efficient_attention", "flash_attention",
                   "softmax", "_softmax")),
    ("cast/copy", ("copy_", "to", "_to_copy", "clone", "contiguous", "empty_like", "cat", "stack")),
    ("gather/scatter/sort", ("index_select", "index_add_", "index_put_", "index", "gather", "scatter", "sort",
                             "argsort", "topk", "repeat_interleave", "cumsum", "bincount", "embedding",
                             "embedding_dense_backward", "_index_put_impl_", "scatter_add_", "histc",
                             "embedding_backward", "index_add")),
    ("optimizer", ("_fused_adamw_", "_foreach", "lerp", "addcdiv", "addcmul")),
)


def kind_of(name: str) -> str:
    op = name.removeprefix("aten::")
    if "scaled_dot_product" in op:
        return "attention"
    for kind, ops in KINDS:
        if op in ops or any(op.startswith(o + "_") and o in ("_foreach",) for o in ops):
            return kind
    if op.startswith("_foreach"):
        return "optimizer"
    return "elementwise/other"


def issue_shape_trainer(dtype: str, threads: int, overrides: list[str] | None = None) -> Trainer:
    """The Trainer `moetrain bench train` builds for qwen3_moe_debug at the issue's shape (`issue_shape.ARGS`)."""
    argv = [*ARGS, "--train.num_threads", str(threads), "--parallel.param_dtype", dtype, *(overrides or [])]
    return trainer_from_args(argv, "issue-shape trainer")


def trainer_from_args(argv: list[str], prog: str) -> Trainer:
    """The Trainer `moetrain bench train` builds for the job `argv` describes, in this process."""
    cfg = parse_job_args(argv, prog=prog)
    data = load_training_data(cfg)
    set_intra_op_threads(cfg.train.num_threads)
    _, world, device = init_distributed(cfg.parallel)
    reuse_freed_host_memory(world, cfg.lora.enabled)  # as `moetrain train` does
    return Trainer(cfg, data, JobMesh.from_config(cfg.parallel, world, device))


def main(argv: list[str]) -> None:
    dtype, argv = take_option(argv, "dtype")
    threads, argv = take_option(argv, "threads")
    steps, argv = take_option(argv, "steps")
    out, argv = take_option(argv, "out")
    shapes_arg, argv = take_option(argv, "shapes")
    shapes = shapes_arg is not None
    trainer = issue_shape_trainer(dtype or "bfloat16", int(threads or 2), argv)
    trainer.train_step()
    n_steps = int(steps or 1)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
        start = time.perf_counter()
        for _ in range(n_steps):
            trainer.train_step()
        wall = (time.perf_counter() - start) / n_steps
    by_kind: dict[str, float] = collections.defaultdict(float)
    rows = []
    for evt in prof.key_averages():
        if not evt.key.startswith("aten::"):
            continue
        self_s = evt.self_cpu_time_total / 1e6 / n_steps
        by_kind[kind_of(evt.key)] += self_s
        rows.append((self_s, evt.key, evt.count // n_steps))
    total = sum(by_kind.values())
    lines = [f"{trainer.cfg.parallel.param_dtype}, {torch.get_num_threads()} threads, {trainer.tokens_per_rank_step} "
             f"tokens/step: step {wall:.3f} s under the profiler, aten self time {total:.3f} s"]
    for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:22s} {seconds:8.3f} s  {100 * seconds / total:5.1f}%")
    lines.append("top ops (self s/step, calls/step):")
    for self_s, key, count in sorted(rows, reverse=True)[:25]:
        lines.append(f"  {key:40s} {self_s:8.3f} s  {count:6d}  [{kind_of(key)}]")
    if shapes:  # the heaviest (op, input shapes) pairs
        lines.append("top ops by input shapes:")
        for evt in sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)[:40]:
            lines.append(f"  {evt.key:32s} {evt.self_cpu_time_total / 1e6 / n_steps:8.3f} s {evt.count // n_steps:6d}"
                         f"  {str(evt.input_shapes)[:110]}")
    text = "\n".join(lines)
    print(text, flush=True)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
