"""Exposed communication per training step on 4 gloo ranks, before (main's code) and after (this tree's), side by side.

The exposed communication fraction of a step is the share of the step's wall time the training thread
spends blocked in collectives: inside a synchronous collective call, or inside `wait()` on an
asynchronous one (FSDP's all-gathers and reduce-scatters, the loss's token-count all-reduce, and under
EP the all-to-alls: `AllToAllStats`, which counts the blocking counts exchange and every wait). Time a
collective spends in flight while the thread computes is hidden, not exposed. Per rank and step:

    exposed = (seconds blocked in torch.distributed calls and their Works' waits + AllToAllStats seconds) / step

where the step runs from a barrier through the global-balance counting pass (`prepare_global_balance`,
where the model's loss needs it), forward, backward and the optimizer step, as `moetrain.bench.ep` runs
it (`accumulation`, `token_loss_sum`, `microbatch_loss`, the job's optimizer).
The clock wraps `torch.distributed`'s collective functions in the worker only (a synchronous call is
timed whole; an asynchronous one's launch is timed and its Work is wrapped so that its wait is timed
too); moetrain is not changed. The same clock runs on both trees.

Limits on this machine (2 cores shared by the 4 ranks and other jobs): "blocked" includes waiting for a
peer that is descheduled or still computing (load imbalance), not only bytes on the wire; gloo moves
bytes with the CPU, so communication hidden behind compute still competes with it for the same cores,
and a lower exposed fraction need not mean a shorter step. On a GPU cluster the same hidden time is
free (NICs and copy engines), which is what the overlap is for.

Runs, per round, every scenario (EP 4 and FSDP 4 on tiny_moe and on qwen3_moe_debug at small shapes)
once with main's source and once with this tree's, alternating which goes first, each a fresh
`torchrun --standalone` of 4 ranks (1 thread each):

    PYTHONPATH=$PWD/src:$PWD nice -n 5 python benchmarks/parallel/comm_overlap.py --baseline ../main --rounds 2 \
        --scenarios "tiny_moe EP4" "tiny_moe FSDP4" --json benchmarks/results/comm_overlap_tiny_moe.json

Writes the JSON (default benchmarks/results/comm_overlap.json) and a .png beside it.
Benchmark only: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# name -> (config, ep, microbatch size, sequence length)
SCENARIOS = {
    "tiny_moe EP4": ("configs/tiny_moe.toml", 4, 2, 256),
    "tiny_moe FSDP4": ("configs/tiny_moe.toml", 1, 2, 256),
    "qwen3_moe_debug EP4": ("configs/qwen3_moe_debug.toml", 4, 1, 128),
    "qwen3_moe_debug FSDP4": ("configs/qwen3_moe_debug.toml", 1, 1, 128),
}
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_reduce", "broadcast", "batch_isend_irecv", "all_gather")


# ----------------------------------------------------------------------------- worker (one torchrun rank)


class BlockedClock:
    """Seconds the calling thread spent inside `torch.distributed` collectives and waits on their Works."""

    def __init__(self):
        import torch.distributed as dist

        self.seconds = 0.0
        self.by_op: dict[str, float] = {}  # the same seconds, by the collective that issued them
        self._dist = dist
        self._originals = {name: getattr(dist, name) for name in COLLECTIVES}
        clock = self

        class TimedWork(dist.Work):
            def __init__(self, work, op):
                super().__init__()
                self._work, self._op = work, op

            def wait(self, timeout=None):
                begin = time.perf_counter()
                try:
                    return self._work.wait()
                finally:
                    clock._add(self._op, time.perf_counter() - begin)

            def is_completed(self):
                return self._work.is_completed()

            def get_future(self):
                return self._work.get_future()

        self._timed_work = TimedWork

    def _add(self, op: str, seconds: float) -> None:
        self.seconds += seconds
        self.by_op[op] = self.by_op.get(op, 0.0) + seconds

    def _wrap(self, result, op: str):
        if isinstance(result, list):
            return [self._wrap(item, op) for item in result]
        return self._timed_work(result, op) if isinstance(result, self._dist.Work) else result

    def __enter__(self) -> BlockedClock:
        for name, original in self._originals.items():
            def timed(*args, _original=original, _op=name, **kwargs):
                begin = time.perf_counter()
                try:
                    return self._wrap(_original(*args, **kwargs), _op)
                finally:
                    self._add(_op, time.perf_counter() - begin)
            setattr(self._dist, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(self._dist, name, original)

    def take(self) -> tuple[float, dict[str, float]]:
        seconds, by_op, self.seconds, self.by_op = self.seconds, self.by_op, 0.0, {}
        return seconds, by_op


def _job(config: str, ep: int, microbatch: int, seq_len: int):
    from dataclasses import replace

    from moetrain.config.job import load

    cfg = load(str(REPO / config))
    parallel = replace(cfg.parallel, ep=ep, dp_replicate=1, dp_shard=-1)
    data = replace(cfg.data, seq_len=seq_len)
    train = replace(cfg.train, microbatch_size=microbatch, grad_accum=1, seed=0, num_threads=1)
    return replace(cfg, parallel=parallel, data=data, train=train).validate()


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from moetrain.bench.ep import _step
    from moetrain.data.packing import Batch
    from moetrain.parallel.expert_parallel import all_to_all_stats
    from moetrain.parallel.grad_sync import resolve_sync_policy
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed
    from moetrain.train.build import build_for_job
    from moetrain.train.global_balance import prepare_global_balance
    from moetrain.train.optim import build_optimizer

    config, ep, microbatch, seq_len = SCENARIOS[args.scenario]
    job = _job(config, ep, microbatch, seq_len)
    rank, world, device = init_distributed(job.parallel)
    torch.set_num_threads(1)
    mesh = JobMesh.from_config(job.parallel, world, device)
    torch.manual_seed(0)
    model = build_for_job(job, mesh)
    optimizer = build_optimizer(model, job.train)
    policy = resolve_sync_policy(job.parallel, mesh.dims, 1)
    a2a = all_to_all_stats(model)
    rows = []
    with BlockedClock() as clock:
        for step in range(args.warmup + args.steps):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            tokens = torch.randint(0, job.model.vocab_size, (microbatch, seq_len + 1), generator=gen)
            dist.barrier()
            clock.take()
            if a2a is not None:
                a2a.take()
            inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            positions = torch.arange(seq_len).expand(microbatch, seq_len).contiguous()
            start = time.perf_counter()
            # The trainer's counting pass (qwen3_moe_debug's global-batch balance loss; a no-op for tiny_moe).
            prepare_global_balance(model, [Batch(inputs, positions, torch.zeros_like(inputs), targets)])
            _step(model, optimizer, policy, [(inputs, targets)])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_s = time.perf_counter() - start
            collective_s, by_op = clock.take()
            a2a_s = a2a.take()[0] if a2a is not None else 0.0
            if step >= args.warmup:
                rows.append({"step_s": step_s, "collective_s": collective_s, "all_to_all_s": a2a_s, "by_op": by_op})
    everyone, rss = [None] * world, [None] * world
    dist.all_gather_object(everyone, rows)
    dist.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # KiB on Linux
    if rank == 0:
        Path(args.out).write_text(json.dumps({"ranks": everyone, "tokens_per_step": world * microbatch * seq_len,
                                              "peak_rss_mib": max(rss)}))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver


def _run(tree: str, src: Path, scenario: str, opts) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "PYTHONPATH": f"{src}:{REPO}", "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                   str(Path(__file__).resolve()), "--worker", "--scenario", scenario, "--out", str(out),
                   "--steps", str(opts.steps), "--warmup", str(opts.warmup)]
        begin = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=opts.timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{tree} {scenario} failed:\n{done.stderr[-3000:]}")
        result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - begin
    return result


def summarize(result: dict) -> dict:
    """Per step: the mean over ranks of exposed / step and the slowest rank's step; medians over steps."""
    steps = list(zip(*result["ranks"], strict=True))
    fractions = [statistics.mean((r["collective_s"] + r["all_to_all_s"]) / r["step_s"] for r in ranks)
                 for ranks in steps]
    a2a = [statistics.mean(r["all_to_all_s"] / r["step_s"] for r in ranks) for ranks in steps]
    step_s = [max(r["step_s"] for r in ranks) for ranks in steps]
    return {"exposed_fraction": statistics.median(fractions), "all_to_all_fraction": statistics.median(a2a),
            "step_s": statistics.median(step_s), "tokens_per_s": result["tokens_per_step"] / statistics.median(step_s)}


def _git(path: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--scenario", choices=list(SCENARIOS))
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS))
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--baseline", help="a checkout of the code before (its src/ is run); the driver needs it")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts)
        return
    if not opts.baseline:
        parser.error("--baseline: a checkout of the code before is required")
    load_at_start = os.getloadavg()
    from moetrain.bench import results_dir

    trees = {"before": Path(opts.baseline) / "src", "after": REPO / "src"}
    runs: dict[str, dict[str, list]] = {s: {"before": [], "after": []} for s in opts.scenarios}
    for round_index in range(opts.rounds):
        for scenario in opts.scenarios:
            order = ["before", "after"] if round_index % 2 == 0 else ["after", "before"]
            for tree in order:
                result = _run(tree, trees[tree], scenario, opts)
                runs[scenario][tree].append(result)
                line = summarize(result)
                print(f"round {round_index} {scenario:22s} {tree:6s} exposed {line['exposed_fraction']:.3f} "
                      f"(a2a {line['all_to_all_fraction']:.3f}) step {line['step_s']:.3f} s "
                      f"{line['tokens_per_s']:.0f} tok/s", flush=True)
    report = {"before_commit": _git(Path(opts.baseline) / "src", "rev-parse", "HEAD"),
              "after_commit": _git(REPO, "rev-parse", "HEAD"), "rounds": opts.rounds, "steps": opts.steps,
              "warmup": opts.warmup, "machine": f"{os.cpu_count()} cores; 4 gloo ranks, 1 thread each",
              "loadavg_at_start": load_at_start, "loadavg_at_end": os.getloadavg(),
              "scenarios": {}}
    print(f"\n{'scenario':24s} {'exposed before':>15s} {'exposed after':>14s} {'tok/s before':>13s} "
          f"{'tok/s after':>12s} {'after/before':>13s}")
    for scenario, trees_runs in runs.items():
        rows = {tree: [summarize(r) for r in results] for tree, results in trees_runs.items()}
        merged = {tree: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for tree, rs in rows.items()}
        ratio = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rows["after"], rows["before"],
                                                                                        strict=True))
        report["scenarios"][scenario] = {"runs": rows, "median": merged, "tokens_per_s_ratio": ratio,
                                         "raw": trees_runs}
        before, after = merged["before"], merged["after"]
        print(f"{scenario:24s} {before['exposed_fraction']:15.3f} {after['exposed_fraction']:14.3f} "
              f"{before['tokens_per_s']:13.0f} {after['tokens_per_s']:12.0f} {ratio:13.3f}")
    out = Path(opts.json) if opts.json else results_dir() / "comm_overlap.json"
    out.write_text(json.dumps(report, indent=1))
    _plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["scenarios"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for offset, tree in ((-width / 2, "before"), (width / 2, "after")):
        xs = [i + offset for i in range(len(names))]
        axes[0].bar(xs, [report["scenarios"][n]["median"][tree]["exposed_fraction"] for n in names], width, label=tree)
        axes[1].bar(xs, [report["scenarios"][n]["median"][tree]["tokens_per_s"] for n in names], width, label=tree)
    for ax, title in zip(axes, ("exposed communication / step", "tokens/s (4 ranks)"), strict=True):
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend()
    fig.suptitle("Communication overlap, 4 gloo ranks on 2 shared cores (median of rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
