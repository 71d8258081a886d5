"""The pipeline's bubble measured in moetrain's own PP step against `moetrain.bench.simulate_pipeline`'s prediction,
and step time / peak RSS per rank of PP 2 x FSDP 2 against FSDP 4 and EP 4 on the same model and global batch.

Each round runs, one after the other (the order reversed every other round, so drift of a shared machine
hits all alike), the three layouts of `pp_layouts.py` (`moetrain bench train` under torchrun, 4 gloo
ranks) and, per schedule (1F1B; Interleaved1F1B and ZBVZeroBubble with 2 stages per rank), one PP 2 x
FSDP 2 training job of this script's own worker: the Trainer exactly as `moetrain train` builds it,
with every `PipelineStage` forward, backward (full, input, weight) and the last stage's loss timed
(class-level wrappers installed in the worker only; moetrain is not changed). From one step's
timings:

- measured bubble = 1 - (compute seconds of the pipeline's ranks) / (pp x (last compute end - first
  compute start)), per data-parallel lane (one pipeline), mean over lanes;
- predicted bubble = the simulator on the same step's measured per-(stage, microbatch) action seconds,
  torch's action order, and the pipeline hand-off time measured by a send/recv ping-pong of one
  microbatch's hidden states on the pipeline group.

    PYTHONPATH=$PWD/src:$PWD nice -n 5 python benchmarks/parallel/pp_bubble.py --rounds 2

Writes benchmarks/results/pp_bubble.json and .png. Benchmark only: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from benchmarks.parallel.pp_layouts import layouts
from benchmarks.parallel.pp_layouts import run as run_layout

from moetrain.bench import results_dir
from moetrain.bench.simulate_pipeline import Action, StageSync, action_dependencies, schedule_order, simulate_pipeline

REPO = Path(__file__).resolve().parents[2]
SCHEDULES = {"1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2}  # schedule -> stages per rank
PP = 2


# ----------------------------------------------------------------------------- worker (one torchrun rank)


def _instrument(events: list) -> None:
    """Time every stage action into `events` as (kind, stage, microbatch, start, end)."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.pipelining.stage import _PipelineStageBase

    def timed(method, kind_of):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            start = time.perf_counter()
            out = method(self, *args, **kwargs)
            kind, stage, microbatch = kind_of(self, *args, **kwargs)
            events.append((kind, stage, microbatch, start, time.perf_counter()))
            return out
        return wrapper

    stage = _PipelineStageBase
    stage.forward_one_chunk = timed(stage.forward_one_chunk, lambda s, mb, *a, **k: ("F", s.stage_index, mb))
    stage.backward_one_chunk = timed(stage.backward_one_chunk, lambda s, mb, *a, full_backward=True, **k: (
        "B" if full_backward else "I", s.stage_index, mb))
    stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk,
                                            lambda s, mb, *a, **k: ("W", s.stage_index, mb))
    stage.perform_reduce_grad = timed(stage.perform_reduce_grad, lambda s, *a, **k: ("R", s.stage_index, -1))
    # The last stage's loss runs between its forward and the next action: compute the bubble must not count.
    _PipelineSchedule._maybe_compute_loss = timed(_PipelineSchedule._maybe_compute_loss,
                                                  lambda sched, st, out, tgt, mb, *a, **k: ("L", st.stage_index, mb))


def _ping_pong_s(group, shape: tuple[int, ...], reps: int = 20) -> float:
    """One-way seconds of a hidden-state hand-off between pipeline ranks 0 and 1 (median of `reps` round trips)."""
    import torch
    import torch.distributed as dist

    me, buffer, times = dist.get_rank(group), torch.zeros(shape), []
    peer = dist.get_global_rank(group, 1 - me)
    for _ in range(reps):
        start = time.perf_counter()
        if me == 0:
            dist.send(buffer, peer, group=group)
            dist.recv(buffer, peer, group=group)
        else:
            dist.recv(buffer, peer, group=group)
            dist.send(buffer, peer, group=group)
        times.append((time.perf_counter() - start) / 2)
    return float(np.median(times))


def worker(argv: list[str], steps: int, warmup: int, out: str) -> None:
    import torch.distributed as dist

    from moetrain.bench.train import peak_memory_bytes
    from moetrain.config.job import parse_job_args
    from moetrain.data.dataset import load_training_data
    from moetrain.parallel.process_group import distributed_job
    from moetrain.runtime.threads import set_intra_op_threads
    from moetrain.train.trainer import Trainer

    events: list = []
    _instrument(events)
    cfg = parse_job_args(argv, prog="pp_bubble worker")
    data = load_training_data(cfg)
    set_intra_op_threads(cfg.train.num_threads)
    with distributed_job(cfg.parallel) as job:
        trainer = Trainer(cfg, data, job)
        hidden = (cfg.train.microbatch_size, cfg.data.seq_len, cfg.model.dim)
        p2p_s = _ping_pong_s(trainer.pipeline.pipeline_group, hidden)
        steps_events, step_s = [], []
        for index in range(warmup + steps):
            events.clear()
            result = trainer.train_step()
            if index >= warmup:
                steps_events.append(list(events))
                step_s.append(result.step_s)
        record = {"rank": dist.get_rank(), "pp_rank": job.pipeline.get_local_rank(), "lane": job.data_rank,
                  "p2p_s": p2p_s, "events": steps_events, "step_s": step_s, **peak_memory_bytes(job.device)}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, record)
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps({"config": cfg.to_dict(), "ranks": gathered}))


# ----------------------------------------------------------------------------- analysis


def analyse_step(ranks: list[dict], step: int, schedule: str, stages_per_rank: int, n_microbatches: int) -> dict:
    """Measured and predicted bubble of one step from every rank's action timings.

    The lanes (the data-parallel ranks of a stage, one pipeline each) are coupled where their FSDP
    collectives are: each stage's gradient reduction after its last backward (`R`, torch's
    REDUCE_GRAD), which under the looped schedules falls inside the compute window. The simulator gets
    it as a reduce-scatter over every lane, lasting the shortest of the lanes' measured `R` (the last
    lane to arrive waits for no one).
    """
    lanes = sorted({r["lane"] for r in ranks})
    n_stages = PP * stages_per_rank
    order = schedule_order(schedule, PP, stages_per_rank, n_microbatches)
    kinds = {a.kind for actions in order.values() for a in actions}
    costs = {k: np.zeros((1, len(lanes), n_stages, n_microbatches)) for k in kinds}
    reduce_s = np.full((len(lanes), n_stages), np.nan)
    measured = []
    for lane_index, lane in enumerate(lanes):
        busy, starts, ends = 0.0, [], []
        for rank in (r for r in ranks if r["lane"] == lane):
            for kind, stage, mb, start, end in rank["events"][step]:
                if kind == "R":
                    reduce_s[lane_index, stage] = end - start
                    continue
                # The loss is part of the last stage's forward of that microbatch.
                costs["F" if kind == "L" else kind][0, lane_index, stage, mb] += end - start
                busy += end - start
                starts.append(start)
                ends.append(end)
        measured.append(1 - busy / (PP * (max(ends) - min(starts))))
    p2p_s = statistics.median(r["p2p_s"] for r in ranks)
    overhead_s = schedule_overhead_s(ranks, step, order, p2p_s)
    no_time = (0.0,) * n_stages
    # The first forward's all-gather is inside the measured forward (or, in the multi-stage runtime, issued
    # before the step): only the reduction couples the lanes here.
    sync = StageSync(lambda is_last: (is_last, False), no_time, tuple(np.nanmin(reduce_s, axis=0)), no_time,
                     shard_group_spans_lanes=True, gathers_at_first_forward=False)
    predicted = simulate_pipeline(order, costs, p2p_s, sync, overhead_s)
    return {"measured_bubble": float(np.mean(measured)), "predicted_bubble": float(predicted.bubble_fraction[0]),
            # What each modelled term adds: without the lanes' coupled reduction, without the schedule's overhead.
            "predicted_without_reduce": float(simulate_pipeline(order, costs, p2p_s, None,
                                                                overhead_s).bubble_fraction[0]),
            "predicted_without_overhead": float(simulate_pipeline(order, costs, p2p_s, sync).bubble_fraction[0]),
            "compute_s": float(sum(costs[k].sum() for k in kinds)) / len(lanes), "p2p_s": p2p_s,
            "overhead_s": overhead_s}


def schedule_overhead_s(ranks: list[dict], step: int, order: dict, p2p_s: float) -> float:
    """The schedule's own seconds per action: how much later than its rank was free and its inputs had
    arrived (+ `p2p_s` from another rank) each compute action started, mean over the step's actions
    (a rank's first action, and any after a gradient reduction, left out)."""
    deps = action_dependencies(order)
    rank_of = {a.stage: rank for rank, actions in order.items() for a in actions}
    late = []
    for lane in {r["lane"] for r in ranks}:
        spans: dict[Action, list[float]] = {}
        reductions: dict[int, list[float]] = {}
        for rank in (r for r in ranks if r["lane"] == lane):
            for kind, stage, mb, start, end in rank["events"][step]:
                if kind in ("F", "B", "I", "W"):
                    spans[Action(kind, stage, mb)] = [start, end]
                elif kind == "L":  # the loss extends the last stage's forward
                    spans[Action("F", stage, mb)][1] = end
                elif kind == "R":
                    reductions.setdefault(rank_of[stage], []).append(end)
        for rank, actions in order.items():
            timeline = sorted(actions, key=lambda a: spans[a][0])
            for before, after in zip(timeline, timeline[1:]):
                free = spans[before][1]
                if any(free <= t <= spans[after][0] for t in reductions.get(rank, [])):
                    continue
                ready = max([free] + [spans[d][1] + (p2p_s if rank_of[d.stage] != rank else 0.0)
                                      for d in deps[after]])
                late.append(max(spans[after][0] - ready, 0.0))
    return float(np.mean(late)) if late else 0.0


# ----------------------------------------------------------------------------- driver


def run_bubble(schedule: str, opts: argparse.Namespace) -> dict:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    stages = SCHEDULES[schedule]
    job = ["--config", opts.config, *opts.extra.split(), "--parallel.pp", str(PP), "--parallel.pp_schedule", schedule,
           "--parallel.pp_stages_per_rank", str(stages), "--train.grad_accum", str(opts.microbatches)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bubble.json"
        command = [torchrun, "--standalone", "--nproc-per-node", "4", __file__, "--worker", "--out", str(out),
                   "--steps", str(opts.steps), "--", *job]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
        subprocess.run(command, check=True, cwd=REPO, env=env, capture_output=True)
        raw = json.loads(out.read_text())
    if opts.keep_raw:  # every rank's action timings, for a closer look
        opts.out.with_name(f"{opts.out.stem}_raw_{schedule}.json").write_text(json.dumps(raw))
    ranks = raw["ranks"]
    steps = [analyse_step(ranks, k, schedule, stages, opts.microbatches) for k in range(opts.steps)]
    return {"schedule": schedule, "stages_per_rank": stages, "steps": steps,
            "step_s": [max(r["step_s"][k] for r in ranks) for k in range(opts.steps)],
            "peak_rss_mib": max(r["peak_rss_bytes"] for r in ranks) / 2**20}


def summarise(layout_runs: dict, bubble_runs: dict) -> dict:
    layouts_summary = {name: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
                       for name, rows in layout_runs.items()}
    bubbles = {}
    for schedule, rows in bubble_runs.items():
        steps = [s for row in rows for s in row["steps"]]
        measured = statistics.median(s["measured_bubble"] for s in steps)
        predicted = statistics.median(s["predicted_bubble"] for s in steps)
        errors = [s["predicted_bubble"] / s["measured_bubble"] - 1 for s in steps]
        bubbles[schedule] = {"measured_bubble": measured, "predicted_bubble": predicted,
                             "relative_error_median": statistics.median(errors),
                             "relative_error_max_abs": max(abs(e) for e in errors),
                             "step_s": statistics.median(s for row in rows for s in row["step_s"]),
                             "p2p_s": statistics.median(s["p2p_s"] for s in steps), "n_steps": len(steps)}
    return {"layouts": layouts_summary, "bubbles": bubbles}


def table(summary: dict) -> str:
    lines = [f"{'layout':<12} {'step s':>8} {'tokens/s':>9} {'peak RSS/rank MiB':>18}"]
    for name, row in summary["layouts"].items():
        lines.append(f"{name:<12} {row['step_s']:>8.2f} {row['tokens_per_s']:>9.0f} {row['peak_rss_mib']:>18.0f}")
    lines.append(f"\n{'PP 2 x FSDP 2':<16} {'bubble measured':>15} {'predicted':>10} {'error (median)':>15} "
                 f"{'max |error|':>12} {'steps':>6} {'hand-off ms':>12}")
    for schedule, row in summary["bubbles"].items():
        lines.append(f"{schedule:<16} {row['measured_bubble']:>15.3f} {row['predicted_bubble']:>10.3f} "
                     f"{row['relative_error_median']:>+15.1%} {row['relative_error_max_abs']:>12.1%} "
                     f"{row['n_steps']:>6} {row['p2p_s'] * 1e3:>12.2f}")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_layout, ax_bubble) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(summary["layouts"])
    ax_layout.bar(names, [summary["layouts"][n]["step_s"] for n in names], color="#6d9dc5")
    ax_layout.set_ylabel("median step s (4 gloo ranks, same global batch)")
    ax_layout.set_title("step time per layout")
    schedules = list(summary["bubbles"])
    xs = np.arange(len(schedules))
    ax_bubble.bar(xs - 0.2, [summary["bubbles"][s]["measured_bubble"] for s in schedules], 0.4, label="measured")
    ax_bubble.bar(xs + 0.2, [summary["bubbles"][s]["predicted_bubble"] for s in schedules], 0.4,
                  label="simulator, measured action costs")
    ax_bubble.set_xticks(xs, schedules)
    ax_bubble.set_ylabel("bubble fraction")
    ax_bubble.set_title("PP 2 x FSDP 2 bubble")
    ax_bubble.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny_moe.toml")
    parser.add_argument("--accum", type=int, default=2, help="microbatches per data rank of FSDP 4 / EP 4")
    parser.add_argument("--microbatches", type=int, default=4, help="the schedule's microbatches (bubble runs)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--extra", default="--data.seq_len 256 --train.microbatch_size 2")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--skip-layouts", action="store_true")
    parser.add_argument("--keep-raw", action="store_true", help="also write each bubble run's raw action timings")
    parser.add_argument("--out", type=Path, default=results_dir() / "pp_bubble.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opts, job_argv = parser.parse_known_args()
    if opts.worker:
        worker([a for a in job_argv if a != "--"], opts.steps, 1, str(opts.out))
        return
    names = [] if opts.skip_layouts else list(layouts(opts.accum))
    layout_runs: dict[str, list[dict]] = {name: [] for name in names}
    bubble_runs: dict[str, list[dict]] = {schedule: [] for schedule in opts.schedules}
    for round_ in range(opts.rounds):
        jobs = [("layout", n) for n in names] + [("bubble", s) for s in opts.schedules]
        for kind, name in jobs if round_ % 2 == 0 else jobs[::-1]:
            if kind == "layout":
                result = run_layout(layouts(opts.accum)[name] + opts.extra.split(), opts.config, opts.steps)
                row = {"step_s": result["step_s_median"], "tokens_per_s": result["tokens_per_s"],
                       "peak_rss_mib": max(m["peak_rss_bytes"] for m in result["memory_per_rank"]) / 2**20,
                       "tokens_per_step": result["tokens_per_step"]}
                layout_runs[name].append(row)
            else:
                row = run_bubble(name, opts)
                bubble_runs[name].append(row)
                row = {k: row[k] for k in ("step_s", "peak_rss_mib")} | {
                    "bubble": [(round(s["measured_bubble"], 3), round(s["predicted_bubble"], 3)) for s in row["steps"]]}
            print(f"round {round_} {name}: {row}", flush=True)
    summary = summarise(layout_runs, bubble_runs) if names else summarise({}, bubble_runs)
    print(table(summary))
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps({"options": {k: str(v) for k, v in vars(opts).items()}, "summary": summary,
                                    "layout_runs": layout_runs, "bubble_runs": bubble_runs}, indent=1) + "\n")
    plot(summary, opts.out.with_suffix(".png"))
    print(f"json: {opts.out}\nfigure: {opts.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
