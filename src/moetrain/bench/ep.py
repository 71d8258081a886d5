"""`moetrain bench ep`: FSDP-only against expert parallelism on spawned gloo ranks, same model and global batch.

Modes are expert-parallel degrees (`--eps 1 2 4`; 1 = FSDP-only), all on the 1-D data-parallel
mesh of `--world` ranks, built by the project's own path (`mesh.JobMesh`, `build.build_for_job`:
EP, FSDP, init). Every rank feeds the same synthetic token batches to every mode, so the global
batch is identical.

Timing run (one spawn, every mode's model side by side): each measured step runs once in every
mode, in an order that rotates with the step, from a barrier to the end of the last backward (the
optimizer step follows, untimed). Per rank and step it records the step time, the compute inside
the transformer blocks (`bench.sync_model.ComputeClock` probes, so FSDP's collectives fall outside)
minus the all-to-all time (`AllToAllStats`), and the bytes every all-gather produced and received
(FSDP2 calls `dist.all_gather_single`; the expert-FSDP group's calls are the expert gathers under EP,
and under FSDP-only the expert share of the MoE blocks' gathers). Then alpha-beta points on the
run's own groups (all-gather, reduce-scatter, all-reduce, all-to-all).

Memory runs (one fresh spawn per mode, so one mode's peak cannot hide another's): a few full
steps with AdamW, then every rank's peak RSS (`ru_maxrss`).

Prediction (`moetrain.bench.simulate` on this run's numbers): one alpha-beta link fitted to all
the points, each mode's measured compute per microbatch, and a per-collective-call overhead fitted
on the FSDP-only mode alone; the EP modes are then predicted, not fitted. This module measures and
reports; it must not change how training runs.
"""

from __future__ import annotations

import inspect
import json
import math
import resource
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moetrain.args import check_output_path, parse_typed_args, read_input_json
from moetrain.bench import results_dir
from moetrain.bench.simulate import CommModel, Experts, Link, Workload, collective_times, simulate_step_times
from moetrain.bench.sync_calibration import calibrate_comm
from moetrain.bench.sync_report import bootstrap_ratio_ci
from moetrain.config.job import JobConfig, load
from moetrain.config.parallel import check_world_size
from moetrain.errors import ConfigError
from moetrain.parallel.collectives import all_gather_floats
from moetrain.parallel.expert_parallel import all_to_all_stats, expert_parameters
from moetrain.parallel.grad_sync import accumulation, count_global_tokens, resolve_sync_policy
from moetrain.parallel.mesh import JobMesh
from moetrain.parallel.process_group import init_distributed
from moetrain.testing import run_on_ranks
from moetrain.train.build import build_for_job
from moetrain.train.loss import microbatch_loss, token_loss_sum
from moetrain.train.optim import build_optimizer

RESULTS = results_dir()


@dataclass
class EpBenchOptions:
    """FSDP-only vs expert parallelism on `world` spawned gloo ranks: the same model and global batch."""

    config: str = "configs/tiny_moe.toml"  # the job whose [model] is benchmarked
    world: int = 4
    eps: tuple[int, ...] = (1, 2, 4)  # expert-parallel degrees; 1 = FSDP-only (the reference)
    steps: int = 10  # measured steps; each runs once in every mode
    warmup_steps: int = 2  # run first in every mode and discarded
    microbatch_size: int = 2  # sequences per rank and microbatch
    seq_len: int = 512  # tiny_moe trains on sequences of 512
    grad_accum: int = 1
    memory_steps: int = 3  # full steps (with AdamW) of each mode's memory run
    memory: bool = True  # run the per-mode memory spawns
    threads_per_rank: int = 1
    seed: int = 0
    json: str | None = None  # default: benchmarks/results/bench_ep_<config stem>.json
    timeout_s: float = 3600.0
    report: str | None = None  # instead of running: print the report of this saved bench JSON


def _job(opts: EpBenchOptions, ep: int) -> JobConfig:
    cfg = load(opts.config)
    parallel = replace(cfg.parallel, ep=ep, dp_replicate=1, dp_shard=-1)
    data = replace(cfg.data, seq_len=opts.seq_len)
    train = replace(cfg.train, microbatch_size=opts.microbatch_size, grad_accum=opts.grad_accum,
                    seed=opts.seed, num_threads=opts.threads_per_rank)
    return replace(cfg, parallel=parallel, data=data, train=train).validate()


def validate_options(opts: EpBenchOptions) -> None:
    for name in ("world", "steps", "microbatch_size", "seq_len", "grad_accum", "memory_steps", "threads_per_rank"):
        if getattr(opts, name) < 1:
            raise ConfigError(f"{name} = {getattr(opts, name)!r} is invalid: must be a positive integer")
    if opts.warmup_steps < 0:
        raise ConfigError(f"warmup_steps = {opts.warmup_steps!r} is invalid: must be >= 0")
    if opts.timeout_s <= 0:
        raise ConfigError(f"timeout_s = {opts.timeout_s!r} is invalid: must be > 0 seconds")
    if opts.json:
        check_output_path(opts.json, "--json")
    if not opts.eps or opts.eps[0] != 1 or len(set(opts.eps)) != len(opts.eps):
        raise ConfigError(f"eps = {list(opts.eps)} is invalid: distinct degrees starting with 1 (FSDP-only)")
    for ep in opts.eps:
        check_world_size(_job(opts, ep).parallel, opts.world)


# ---- what a rank measures -------------------------------------------------------------------------

class CollectiveRecorder:
    """Wraps FSDP2's collectives (`dist.all_gather_single`, `dist.reduce_scatter_single`, `dist.all_reduce`) to
    record every call: (op, group, output bytes, bytes received from other ranks, seconds).

    A call's duration is the collective (waiting for the slowest member included): an asynchronous one (FSDP's
    prefetched gathers, `parallel.fsdp_prefetch`) is waited for inside the wrapper, so under this recorder the
    gathers do not overlap compute (benchmarks/parallel/comm_overlap.py measures the overlap itself).
    FSDP2 skips the all-gather of a one-rank group (it copies the shard): nothing recorded.
    """

    OPS = ("all_gather_single", "reduce_scatter_single", "all_reduce")

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float, float, float]] = []
        self._originals: dict[str, Any] = {}

    def __enter__(self) -> CollectiveRecorder:
        for op in self.OPS:
            self._originals[op] = original = getattr(dist, op)
            signature = inspect.signature(original)

            def recording(*args, _op=op, _original=original, _signature=signature, **kwargs):
                begin = time.perf_counter()
                work = _original(*args, **kwargs)
                if work is not None:  # async: the wait is the collective (waiting again later is free)
                    work.wait()
                seconds = time.perf_counter() - begin
                bound = _signature.bind(*args, **kwargs).arguments
                output = next(iter(bound.values()))
                out_bytes = output.numel() * output.element_size()
                received = 0.0
                if _op == "all_gather_single":
                    received = out_bytes - bound["input_tensor"].numel() * bound["input_tensor"].element_size()
                self.calls.append((_op, id(bound.get("group")), out_bytes, received, seconds))
                return work

            setattr(dist, op, recording)
        return self

    def __exit__(self, *exc) -> None:
        for op, original in self._originals.items():
            setattr(dist, op, original)

    def take(self) -> list[tuple[str, int, float, float, float]]:
        taken, self.calls = self.calls, []
        return taken


def _batches(opts: EpBenchOptions, vocab: int, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's microbatches of one step: a function of (seed, step, rank, microbatch) only."""
    out = []
    for micro in range(opts.grad_accum):
        seed = int(np.random.SeedSequence([opts.seed, step, rank, micro]).generate_state(1)[0])
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (opts.microbatch_size, opts.seq_len + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _step(model, optimizer, policy, microbatches) -> None:
    global_tokens = count_global_tokens(sum(int(t.numel()) for _, t in microbatches))
    for (tokens, targets), _ in accumulation(model, microbatches, policy):
        loss_sum, n_valid = token_loss_sum(model(tokens), targets)
        microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()


def _gathered_bytes(params, world: int) -> float:
    """All-gather output bytes of `params` under FSDP over `world` ranks (each dim 0 padded to the world)."""
    return sum(math.ceil(p.shape[0] / world) * world * math.prod(p.shape[1:]) * p.element_size() for p in params)


def _timing_worker(opts: EpBenchOptions) -> dict[str, Any] | None:
    rank, world, device = init_distributed(_job(opts, 1).parallel)
    modes = {}
    for ep in opts.eps:
        job = _job(opts, ep)
        mesh = JobMesh.from_config(job.parallel, world, device)
        torch.manual_seed(job.train.seed)
        model = build_for_job(job, mesh)
        modes[ep] = {
            "model": model, "optimizer": build_optimizer(model, job.train), "mesh": mesh,
            "policy": resolve_sync_policy(job.parallel, mesh.dims, opts.grad_accum), "a2a": all_to_all_stats(model),
            "expert_group": None if mesh.experts is None else mesh.experts.fsdp.get_group(),
            "moe_block_gather": _gathered_bytes(model.moe_layers()[0].experts.parameters(), world),
            "moe_block_bytes": _gathered_bytes(next(b for b in model.layers if b.is_moe).parameters(), world),
        }
    vocab = _job(opts, 1).model.vocab_size
    records: dict[int, list[list[float]]] = {ep: [] for ep in opts.eps}
    with CollectiveRecorder() as collectives:
        for step in range(opts.warmup_steps + opts.steps):
            microbatches = _batches(opts, vocab, step, rank)
            order = list(opts.eps[step % len(opts.eps):]) + list(opts.eps[:step % len(opts.eps)])
            for ep in order:
                mode = modes[ep]
                if mode["a2a"] is not None:
                    mode["a2a"].take()
                dist.barrier()
                collectives.take()
                start = time.perf_counter()
                _step(mode["model"], mode["optimizer"], mode["policy"], microbatches)
                step_s = time.perf_counter() - start
                a2a_s, sent, received = mode["a2a"].take() if mode["a2a"] is not None else (0.0, 0, 0)
                calls = collectives.take()
                fsdp_s = sum(c[4] for c in calls)
                expert_out, expert_in, all_out, all_in = _gather_split(calls, mode)
                mode["optimizer"].step()
                mode["optimizer"].zero_grad(set_to_none=True)
                row = all_gather_floats([step_s, step_s - fsdp_s - a2a_s, fsdp_s, a2a_s, sent, received, expert_out,
                                         expert_in, all_out, all_in])
                if step >= opts.warmup_steps:
                    records[ep].append(row)
    calibration = _calibrate(opts, modes, rank, world)
    if rank != 0:
        return None
    return {"records": {ep: rows for ep, rows in records.items()}, "calibration": calibration,
            "layout": _layout(opts, modes, world)}


def _gather_split(calls: list[tuple[str, int, float, float, float]], mode: dict) -> tuple[float, float, float, float]:
    """(expert output bytes, expert received bytes, all output bytes, all received bytes) of one step's all-gathers."""
    gathers = [c for c in calls if c[0] == "all_gather_single"]
    all_out, all_in = sum(c[2] for c in gathers), sum(c[3] for c in gathers)
    if mode["expert_group"] is not None:  # EP: the expert-FSDP group's calls gather experts only
        mine = [c for c in gathers if c[1] == id(mode["expert_group"])]
        return sum(c[2] for c in mine), sum(c[3] for c in mine), all_out, all_in
    # FSDP-only: the experts' share of every MoE block's gather (recognised by its size)
    share = mode["moe_block_gather"] / mode["moe_block_bytes"]
    moe = [c for c in gathers if math.isclose(c[2], mode["moe_block_bytes"])]
    return share * sum(c[2] for c in moe), share * sum(c[3] for c in moe), all_out, all_in


def _layout(opts: EpBenchOptions, modes: dict, world: int) -> dict[str, Any]:
    model = modes[opts.eps[0]]["model"]
    cfg = _job(opts, 1).model
    experts = expert_parameters(model)
    expert_bytes = sum(p.numel() * p.element_size() for p in experts)  # global shape under any ep
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = opts.microbatch_size * opts.seq_len
    return {"param_bytes": param_bytes, "expert_param_bytes": expert_bytes,
            "moe_layers": cfg.n_layers - cfg.n_dense_layers, "layers": cfg.n_layers,
            "dispatch_bytes_per_moe_layer": tokens * cfg.moe.top_k * cfg.dim * 4,
            "tokens_per_rank_step": tokens * opts.grad_accum, "world": world}


def _calibrate(opts: EpBenchOptions, modes: dict, rank: int, world: int) -> dict[str, Any]:
    """Alpha-beta points on the run's groups: ring collectives (bench sync's fit) and all-to-alls."""
    groups: dict[str, tuple] = {"world": (dist.group.WORLD, world)}
    a2a_groups: dict[str, tuple] = {}
    for ep in opts.eps[1:]:
        meshes = modes[ep]["mesh"].experts
        groups[f"efsdp{ep}"] = (meshes.fsdp.get_group(), meshes.fsdp.size())
        a2a_groups[f"ep{ep}"] = (meshes.ep.get_group(), ep)
    layout = _layout(opts, modes, world)
    unit_bytes = layout["param_bytes"] / (layout["layers"] + 2)
    ring = calibrate_comm(groups, unit_bytes)
    points = []
    sizes = sorted({layout["dispatch_bytes_per_moe_layer"] / 4, layout["dispatch_bytes_per_moe_layer"], 4e6})
    for name, (group, n) in a2a_groups.items():
        for nbytes in sizes:
            numel = int(nbytes // 4) // n * n
            x, out = torch.ones(numel), torch.empty(numel)
            times = []
            for _ in range(5):
                dist.barrier(group=group)
                begin = time.perf_counter()
                dist.all_to_all_single(out, x, group=group)
                times.append(time.perf_counter() - begin)
            points.append({"group": name, "ranks": n, "op": "all_to_all", "bytes": numel * 4,
                           "seconds": float(np.median(times))})
    return {"ring": ring, "all_to_all": points}


def _memory_worker(opts: EpBenchOptions, ep: int) -> dict[str, float]:
    rank, world, device = init_distributed(_job(opts, ep).parallel)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    job = _job(opts, ep)
    mesh = JobMesh.from_config(job.parallel, world, device)
    torch.manual_seed(job.train.seed)
    model = build_for_job(job, mesh)
    optimizer = build_optimizer(model, job.train)
    policy = resolve_sync_policy(job.parallel, mesh.dims, opts.grad_accum)
    for step in range(opts.memory_steps):
        _step(model, optimizer, policy, _batches(opts, job.model.vocab_size, step, rank))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss_before_model_bytes": rss_before}


# ---- fit, predict, report -------------------------------------------------------------------------

def fit_link(points: list[dict]) -> Link:
    """One alpha-beta link from timed collectives (ring formulas; an all-to-all as a pairwise exchange)."""
    factors = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "all_to_all": 1.0}
    design = np.asarray([[factors[p["op"]] * (p["ranks"] - 1),
                          factors[p["op"]] * (p["ranks"] - 1) / p["ranks"] * p["bytes"]] for p in points])
    target = np.asarray([p["seconds"] for p in points])
    weights = 1 / np.maximum(target, 1e-9)  # relative least squares: small and large messages both count
    (alpha, inv_bandwidth), *_ = np.linalg.lstsq(design * weights[:, None], target * weights, rcond=None)
    return Link(max(float(alpha), 0.0), 1 / max(float(inv_bandwidth), 1e-15))


def _medians(rows: list[list[float]]) -> dict[str, float]:
    """Medians over steps of: the step time of the slowest rank, and the rank mean of every other field.

    Every rank leaves a step at about the same time (the last collectives couple them), so the rank
    means of compute, FSDP collectives and all-to-all add up to the step; per-field maxima would not.
    """
    array = np.asarray(rows)  # [steps, ranks, fields]
    names = ["step_s", "compute_s", "fsdp_collectives_s", "all_to_all_s", "rows_sent", "rows_received",
             "expert_gather_bytes", "expert_received_bytes", "gather_bytes", "received_bytes"]
    per_step = array.mean(axis=1)
    per_step[:, 0] = array[:, :, 0].max(axis=1)
    out = {name: float(np.median(per_step[:, i])) for i, name in enumerate(names)}
    out["step_s_mean"] = float(per_step[:, 0].mean())
    out["rank_mean_step_s"] = float(np.median(array[:, :, 0].mean(axis=1)))
    return out


def _scaled(link: Link, factor: float) -> Link:
    return Link(link.alpha_s * factor, link.bandwidth / factor)


def predict_steps(opts: EpBenchOptions, measured: dict[int, dict], layout: dict, ring: Link,
                  all_to_all: Link) -> dict[str, Any]:
    """Simulated step time per mode: the mode's measured compute + alpha-beta collectives and all-to-alls.

    The links come from the microbenchmarks of the same run, timed on an otherwise idle host. Inside a
    step a collective also waits for peers that share the cores (4 ranks on 2 here), so every collective
    is slowed by one host factor: fitted on the FSDP-only mode alone (its measured collective time over the
    modelled one), then applied unchanged to the EP modes, which are predicted, not fitted.
    """
    units = layout["layers"] + 2  # blocks, embedding, head (the root's norm rides with the last gather)
    experts = Experts(moe_units=layout["moe_layers"], param_bytes=layout["expert_param_bytes"],
                      dispatch_bytes=layout["dispatch_bytes_per_moe_layer"])
    workload = Workload(layers=units, grad_bytes=layout["param_bytes"], overlap="blocking")

    def simulate(ep: int, factor: float) -> tuple[float, float]:
        comm = CommModel(intra=_scaled(ring, factor), inter=_scaled(ring, factor), ranks_per_node=opts.world,
                         all_to_all_link=_scaled(all_to_all, factor))
        compute = np.full((1, opts.grad_accum, 1), measured[ep]["compute_s"] / opts.grad_accum)
        step = float(simulate_step_times(compute, 1, opts.world, "fsdp", workload, comm, experts, ep)[0])
        ct = collective_times("fsdp", 1, opts.world, workload, comm, experts, ep)
        return step, layout["moe_layers"] * opts.grad_accum * (ct.all_to_all_forward + ct.all_to_all_backward)

    idle_comm = simulate(1, 1.0)[0] - measured[1]["compute_s"]  # the modelled FSDP collectives, idle host
    factor = max(1.0, measured[1]["fsdp_collectives_s"] / idle_comm) if idle_comm > 0 else 1.0
    out: dict[str, Any] = {"ring_link": asdict(ring), "all_to_all_link": asdict(all_to_all),
                           "host_factor": factor, "modes": {}}
    for ep in opts.eps:
        predicted, a2a = simulate(ep, factor)
        out["modes"][ep] = {"predicted_step_s": predicted, "measured_step_s": measured[ep]["step_s"],
                            "error": predicted / measured[ep]["step_s"] - 1, "fitted": ep == 1,
                            "predicted_all_to_all_s": a2a, "measured_all_to_all_s": measured[ep]["all_to_all_s"],
                            "predicted_fsdp_collectives_s": predicted - measured[ep]["compute_s"] - a2a,
                            "measured_fsdp_collectives_s": measured[ep]["fsdp_collectives_s"],
                            "idle_host_step_s": simulate(ep, 1.0)[0]}
    return out


def format_table(opts: EpBenchOptions, measured: dict[int, dict], memory: dict[int, list[dict]],
                 prediction: dict) -> str:
    """One row per mode: measured medians (slowest rank), peak RSS, expert bytes gathered, the prediction."""
    ref = measured[1]
    header = (f"{'mode':<9} {'step s':>7} {'/fsdp':>6} {'tok/s':>6} {'compute':>8} {'fsdp comm':>9} {'a2a s':>6} "
              f"{'a2a pred':>8} {'rows out/in':>11} {'RSS MiB':>8} {'/fsdp':>6} {'expert MiB':>10} {'/fsdp':>6} "
              f"{'pred s':>7} {'error':>7}")
    lines = [header]
    tokens = opts.world * opts.microbatch_size * opts.seq_len * opts.grad_accum
    ref_rss = max(r["peak_rss_bytes"] for r in memory[1]) if memory.get(1) else None
    for ep, m in measured.items():
        rss = max(r["peak_rss_bytes"] for r in memory[ep]) if memory.get(ep) else None
        pred = prediction["modes"][ep]
        gathered = m["expert_gather_bytes"] / ref["expert_gather_bytes"] if ref["expert_gather_bytes"] else math.nan
        lines.append(
            f"{'fsdp-only' if ep == 1 else f'ep={ep}':<9} {m['step_s']:>7.3f} {m['step_s'] / ref['step_s']:>6.3f} "
            f"{tokens / m['step_s']:>6.0f} {m['compute_s']:>8.3f} {m['fsdp_collectives_s']:>9.3f} "
            f"{m['all_to_all_s']:>6.3f} {pred['predicted_all_to_all_s']:>8.3f} "
            f"{m['rows_sent']:>5.0f}/{m['rows_received']:<5.0f} "
            + (f"{rss / 2**20:>8.0f} {rss / ref_rss:>6.3f} " if rss else f"{'-':>8} {'-':>6} ")
            + f"{m['expert_gather_bytes'] / 2**20:>10.2f} {gathered:>6.3f} {pred['predicted_step_s']:>7.3f} "
            f"{100 * pred['error']:>+6.1f}%" + (" (fit)" if pred["fitted"] else ""))
    return "\n".join(lines)


def report(opts: EpBenchOptions, records: dict[int, list], memory: dict[int, list[dict]], calibration: dict,
           layout: dict) -> tuple[str, dict[str, Any]]:
    """The printed report and the JSON result from the raw measurements of a run."""
    measured = {ep: _medians(rows) for ep, rows in records.items()}
    step_s = {ep: np.asarray(rows)[:, :, 0].max(axis=1) for ep, rows in records.items()}  # slowest rank per step
    paired = bootstrap_ratio_ci(step_s, 1, resamples=2000, seed=opts.seed)
    ring, all_to_all = fit_link(calibration["ring"]["points"]), fit_link(calibration["all_to_all"])
    prediction = predict_steps(opts, measured, layout, ring, all_to_all)
    lines = [f"moetrain bench ep: {opts.config}, {opts.world} gloo ranks, {opts.microbatch_size} x {opts.seq_len} "
             f"tokens x {opts.grad_accum} microbatches per rank, {len(step_s[1])} steps in every mode, interleaved "
             "(medians: step time of the slowest rank, other columns rank means)",
             format_table(opts, measured, memory, prediction),
             "mean step time / fsdp-only, 95% paired bootstrap interval over steps: "
             + ", ".join(f"{'fsdp-only' if ep == 1 else f'ep={ep}'} {r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]"
                         for ep, r in paired.items()),
             f"alpha-beta fitted on this run's microbenchmarks: ring collectives alpha {ring.alpha_s * 1e6:.0f} us, "
             f"{ring.bandwidth / 1e9:.2f} GB/s; all-to-all alpha {all_to_all.alpha_s * 1e6:.0f} us, "
             f"{all_to_all.bandwidth / 1e9:.2f} GB/s; host factor inside a step (fitted on fsdp-only) "
             f"{prediction['host_factor']:.2f}"]
    result = {"options": asdict(opts), "layout": layout, "measured": measured, "mean_step_ratio_ci": paired,
              "per_step": records, "memory": memory, "calibration": calibration, "prediction": prediction}
    return "\n".join(lines), result


def main(argv: list[str]) -> int:
    opts: EpBenchOptions = parse_typed_args(EpBenchOptions, argv, "moetrain bench ep", bool_flags=True)
    if opts.report:  # re-render a saved run
        saved = read_input_json(opts.report, "--report")
        opts = EpBenchOptions(**{**saved["options"], "eps": tuple(saved["options"]["eps"]), "report": None})
        by_ep = {int(k): v for k, v in saved["per_step"].items()}
        text, _ = report(opts, by_ep, {int(k): v for k, v in saved["memory"].items()}, saved["calibration"],
                         saved["layout"])
        print(text)
        return 0
    validate_options(opts)
    timing = run_on_ranks(_timing_worker, opts.world, opts, timeout=opts.timeout_s,
                          threads_per_rank=opts.threads_per_rank)[0]
    memory: dict[int, list[dict]] = {}
    if opts.memory:
        for ep in opts.eps:
            memory[ep] = run_on_ranks(_memory_worker, opts.world, opts, ep, timeout=opts.timeout_s,
                                      threads_per_rank=opts.threads_per_rank)
    text, result = report(opts, timing["records"], memory, timing["calibration"], timing["layout"])
    print(text)
    path = Path(opts.json) if opts.json else RESULTS / f"bench_ep_{Path(opts.config).stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "time": time.time()}, indent=2, default=str) + "\n")
    print(f"json: {path}")
    return 0
