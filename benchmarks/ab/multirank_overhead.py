"""Where a multi-rank step's time goes: CPU-seconds, bytes copied, allocated and communicated per step, A against B.

`driver` runs each scenario (ranks x dtype) as fresh `torchrun` jobs, today's main (A, `--baseline TREE`)
and this tree (B) alternating, each with its own sources on PYTHONPATH; `worker` is what each rank runs.
It builds the job as `moetrain bench train` does (config, data, allocator settings, process group,
mesh, Trainer), takes `--warmup` steps, then `--steps` timed steps and one counted step:

- per timed step: wall time and this process's CPU time (getrusage RUSAGE_SELF, user and system,
  all threads: gloo's transport threads included). On a shared 2-core machine with 4 ranks a rank
  gets at most half a core, so CPU-seconds per rank, not wall time, are the overhead measure; a
  1-process 1-thread run of the same per-rank work (2 microbatches of 1x128 tokens) is the floor.
- the counted step runs under a TorchDispatchMode that adds up, per aten/c10d/fsdp operator, the
  bytes it writes: copies (copy_, _to_copy, cat, FSDP's copy-in / split_with_sizes_copy / chunk_cat,
  foreach copies, casts), bytes handed to collectives (broadcast, send/recv, all-gather,
  reduce-scatter, all-reduce buffers), and bytes of fresh outputs (allocations). These counts are
  deterministic: they do not depend on the machine's load.
- optional `--profile`: one more step under torch.profiler on rank 0; the top operators by self CPU time.

It prints a table and writes JSON (and the table) under benchmarks/results/:

    PYTHONPATH=$PWD/src:$PWD python benchmarks/ab/multirank_overhead.py driver --baseline ../base \
        --out benchmarks/results/multirank_overhead
    PYTHONPATH=$PWD/src:$PWD python benchmarks/ab/multirank_overhead.py driver --baseline . \
        --b-args "--parallel.ep 4" --ranks 4 --out benchmarks/results/multirank_fsdp_vs_ep
        # A: FSDP over 4 ranks, B: the same with EP 4

Trees are run through `benchmarks/ab/runner.py`.

Benchmark only: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.ab import runner

MARKER = "OVERHEAD_RESULT "
CONFIG = "configs/qwen3_moe_debug.toml"
# bench train's multi-rank shape (benchmarks/results/bench_train_qwen3_moe_debug_fsdp4_*.json).
COMMON = ["--data.seq_len", "128", "--data.max_documents", "300", "--train.microbatch_size", "1",
          "--train.grad_accum", "2", "--train.num_threads", "1"]

COPY_OPS = ("copy_", "_to_copy", "cat", "split_with_sizes_copy", "chunk_cat", "all_gather_copy_in", "_foreach_copy_",
            "clone", "stack", "index_select", "contiguous")
COLLECTIVE_NAMESPACE = "c10d"


def _counting_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class ByteCounter(TorchDispatchMode):
        """Per operator: calls, bytes written (outputs or mutated args), bytes freshly allocated."""

        def __init__(self):
            super().__init__()
            self.ops: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "written": 0, "allocated": 0})

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = f"{func.namespace}.{func._schema.name.split('::')[-1]}"
            row = self.ops[name]
            row["calls"] += 1
            schema_args = func._schema.arguments
            mutated = [kwargs.get(a.name, args[i] if i < len(args) else None) for i, a in enumerate(schema_args)
                       if a.alias_info is not None and a.alias_info.is_write]
            if name == "fsdp.all_gather_copy_in":  # copies the shard into the (already allocated) gather buffer
                row["written"] += _unique_bytes(args[0])
            elif mutated:  # in place or out=: the bytes written into existing tensors
                row["written"] += _unique_bytes(mutated)
            elif func.namespace == COLLECTIVE_NAMESPACE:  # a send: the bytes it hands to gloo
                row["written"] += _unique_bytes((args, kwargs))
            elif not func.is_view:  # a fresh output; a view writes and allocates nothing
                nbytes = _unique_bytes(out)
                row["written"] += nbytes
                row["allocated"] += nbytes
            return out

    def _unique_bytes(value) -> int:
        """Bytes of the tensors in `value`, a tensor aliasing another's storage counted once (the largest)."""
        largest: dict[int, int] = {}
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                try:
                    key = t.untyped_storage().data_ptr()
                except RuntimeError:  # a storage FSDP has freed (resized to 0) or an opaque one
                    key = id(t)
                largest[key] = max(largest.get(key, 0), t.nbytes)
        return sum(largest.values())

    return ByteCounter()


def _cpu_s() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def worker(argv: list[str]) -> None:
    try:  # what `moetrain`'s entry point does before torch loads
        from moetrain.runtime.allocator import huge_pages_for_large_tensors
        huge_pages_for_large_tensors()
    except ImportError:
        pass
    import torch.distributed as dist

    from moetrain.config.job import parse_job_args
    from moetrain.data.dataset import load_training_data
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed
    from moetrain.runtime.allocator import reuse_freed_host_memory
    from moetrain.runtime.threads import set_intra_op_threads
    from moetrain.train.trainer import Trainer

    steps, warmup, profile = int(argv[0]), int(argv[1]), argv[2] == "1"
    cfg = parse_job_args(argv[3:])
    data = load_training_data(cfg)
    set_intra_op_threads(cfg.train.num_threads)
    rank, world, device = init_distributed(cfg.parallel)
    reuse_freed_host_memory(world)
    mesh = JobMesh.from_config(cfg.parallel, world, device)
    trainer = Trainer(cfg, data, mesh)
    for _ in range(warmup):
        trainer.train_step()
    timed = []
    for _ in range(steps):
        user0, sys0 = _cpu_s()
        result = trainer.train_step()
        user1, sys1 = _cpu_s()
        timed.append({"wall_s": result.step_s, "user_s": user1 - user0, "sys_s": sys1 - sys0,
                      "phases": dict(result.phases), "loss": result.loss})
    counter = _counting_mode()
    with counter:
        trainer.train_step()
    ops = {name: dict(row) for name, row in counter.ops.items()}
    top_profile = None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
        if rank == 0:
            with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
                trainer.train_step()
            total = sum(e.self_cpu_time_total for e in prof.key_averages())
            top_profile = [{"op": e.key, "calls": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6,
                            "share": e.self_cpu_time_total / total}
                           for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]]
        else:
            trainer.train_step()
    peak = trainer.peak_flops_per_rank()  # a collective: rank 0 takes the host's peak, shared by its ranks
    mine = {"steps": timed, "ops": ops, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    if rank == 0:
        step_s = statistics.median(max(r["steps"][i]["wall_s"] for r in every) for i in range(steps))
        tokens_per_s = trainer.tokens_per_rank_step * world / step_s
        print(MARKER + json.dumps({
            "world": world, "param_dtype": cfg.parallel.param_dtype, "step_s": step_s, "tokens_per_s": tokens_per_s,
            "mfu": trainer.flops_per_token * tokens_per_s / (peak * world), "peak_flops_per_rank": peak,
            "flops_per_token": trainer.flops_per_token, "tokens_per_rank_step": trainer.tokens_per_rank_step,
            "ranks": every, "profile_rank0": top_profile}), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _summary(result: dict) -> dict:
    """Per-rank medians and the counted step's byte totals (mean over ranks)."""
    ranks = result["ranks"]
    cpu = [statistics.median(s["user_s"] + s["sys_s"] for s in r["steps"]) for r in ranks]
    sys_s = [statistics.median(s["sys_s"] for s in r["steps"]) for r in ranks]

    def total(kind: str, select) -> float:
        return statistics.mean(sum(row[kind] for name, row in r["ops"].items() if select(name)) for r in ranks)

    return {
        "tokens_per_s": result["tokens_per_s"], "step_s": result["step_s"], "mfu": result["mfu"],
        "peak_flops_per_rank": result["peak_flops_per_rank"],
        "cpu_s_per_rank_step": statistics.mean(cpu), "sys_s_per_rank_step": statistics.mean(sys_s),
        "copied_gb": total("written", lambda n: n.split(".")[-1] in COPY_OPS) / 1e9,
        "collective_gb": total("written", lambda n: n.startswith(COLLECTIVE_NAMESPACE + ".")) / 1e9,
        "allocated_gb": total("allocated", lambda n: True) / 1e9,
        "collective_calls": statistics.mean(sum(row["calls"] for name, row in r["ops"].items()
                                                if name.startswith(COLLECTIVE_NAMESPACE + ".")) for r in ranks),
        "peak_rss_mib": max(r["peak_rss_bytes"] for r in ranks) / 2**20,
    }


def _top_ops(result: dict, n: int = 12) -> list[tuple[str, float, float, float]]:
    rows = result["ranks"][0]["ops"]
    ranked = sorted(rows.items(), key=lambda item: -item[1]["written"])[:n]
    return [(name, row["calls"], row["written"] / 1e9, row["allocated"] / 1e9) for name, row in ranked]


def run_one(tree: runner.Tree, ranks: int, dtype: str, steps: int, warmup: int, profile: bool,
            extra: tuple[str, ...] = ()) -> dict:
    args = [CONFIG, *COMMON, "--parallel.param_dtype", dtype, *extra]
    argv = [str(Path(__file__).resolve()), "worker", str(steps), str(warmup), "1" if profile else "0", "--config",
            *args, *(["--parallel.dp_shard", str(ranks)] if ranks > 1 else [])]
    started = time.time()
    result = runner.run(tree, argv, ranks=ranks, marker=MARKER, env=tree.env(OMP_NUM_THREADS="1"))
    result["wall_of_run_s"] = time.time() - started
    return result


def driver(ns: argparse.Namespace) -> None:
    trees = runner.two_trees(ns.baseline)
    out = Path(ns.out)
    results: list[dict] = []
    for ranks in ns.ranks:
        for dtype in ns.dtypes:
            order = ["A", "B"] if ranks > 1 else ["B"]  # the 1-process floor is the same code in both trees
            for label in order:
                extra = tuple((ns.b_args if label == "B" else ns.a_args).split()) if ranks > 1 else ()
                result = run_one(trees[label], ranks, dtype, ns.steps, ns.warmup, ns.profile and ranks > 1, extra)
                row = {"tree": label, "revision": runner.revision(trees[label]), "args": " ".join(extra),
                       "ranks": ranks, "dtype": dtype, **_summary(result), "top_ops_rank0": _top_ops(result),
                       "raw": result}
                results.append(row)
                print(f"{label} ranks={ranks} {dtype}: {row['tokens_per_s']:.1f} tok/s, "
                      f"{row['cpu_s_per_rank_step']:.2f} CPU-s/rank-step", flush=True)
                runner.save(out, {"rows": results})
    text = table(results)
    print(text)
    out.with_suffix(".txt").write_text(text + "\n")


def table(results: list[dict]) -> str:
    head = ("| tree | extra args | ranks | dtype | tokens/s | step s | MFU | CPU-s/rank-step (sys) | copied GB "
            "| collective GB (calls) | allocated GB | peak RSS/rank MiB |")
    lines = [head, "|" + "---|" * 12]
    for r in results:
        lines.append(f"| {r['tree']} | {r.get('args') or '-'} | {r['ranks']} | {r['dtype']} | "
                     f"{r['tokens_per_s']:.1f} | {r['step_s']:.2f} | "
                     f"{100 * r['mfu']:.2f} % of {r['peak_flops_per_rank'] / 1e9:.0f} GFLOP/s | "
                     f"{r['cpu_s_per_rank_step']:.2f} ({r['sys_s_per_rank_step']:.2f}) | {r['copied_gb']:.2f} | "
                     f"{r['collective_gb']:.2f} ({r['collective_calls']:.0f}) | {r['allocated_gb']:.2f} | "
                     f"{r['peak_rss_mib']:.0f} |")
    for r in results:
        lines.append(f"\n{r['tree']} ranks={r['ranks']} {r['dtype']}: rank 0's counted step, top operators by bytes "
                     "written (calls, GB written, GB allocated)")
        lines += [f"  {name:40s} {calls:6.0f} {gb:8.3f} {alloc:8.3f}" for name, calls, gb, alloc in r["top_ops_rank0"]]
        if r["raw"].get("profile_rank0"):
            lines.append("  torch.profiler, rank 0, one step: top operators by self CPU time (share)")
            lines += [f"    {p['op']:38s} {p['calls']:6d} {p['self_cpu_s']:8.2f} s {100 * p['share']:5.1f} %"
                      for p in r["raw"]["profile_rank0"]]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["driver"])
    parser.add_argument("--baseline", required=True, help="checkout of today's main (A); this tree itself "
                        "with --b-args compares two configurations of the same code")
    parser.add_argument("--b-args", default="", help="config overrides for B's multi-rank runs only, e.g. "
                        "'--parallel.ep 4' (A: FSDP over all ranks, B: the same with expert parallelism)")
    parser.add_argument("--a-args", default="", help="config overrides for A's multi-rank runs only")
    parser.add_argument("--out", default=str(runner.RESULTS / "multirank_overhead"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 1])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="one more step under torch.profiler on rank 0")
    driver(parser.parse_args())


if __name__ == "__main__":
    main()
