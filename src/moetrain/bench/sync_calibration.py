"""`moetrain bench sync`'s calibration of the simulator from the run's own measurements.

Three fits: an alpha-beta link from all-reduce / reduce-scatter / all-gather timings on
the bench's process groups (`calibrate_comm`); a rank's compute seconds per microbatch
as a linear function of its work units (`calibrate_compute`, `costs_in_seconds`); and
the per-call FSDP overhead of each mesh from the zero-variance steps
(`fit_per_call_overhead`). This module measures and fits: it must not choose sync
policies, build meshes or report results.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moetrain.bench.simulate import MODES, CommModel, Workload, collective_times, simulate_step_times
from moetrain.bench.simulate_pipeline import pipeline_step_times, schedule_order
from moetrain.bench.sync_model import ComputeClock, microbatch_inputs, work_units
from moetrain.bench.sync_options import SyncBenchOptions
from moetrain.parallel.grad_sync import SYNC_POLICIES, accumulation


def _time_collective(run, group, reps: int) -> float:
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def calibrate_comm(groups: dict[str, tuple], unit_bytes: float, reps: int = 5) -> dict:
    """Time all-reduce / reduce-scatter / all-gather on the bench's groups and fit one alpha-beta link.

    `groups` maps a name to (process group, size). Ring formulas (as in `simulate`):
    reduce-scatter and all-gather (n-1)·α + (n-1)/n·B/β, all-reduce twice that.
    """
    rows, measured = [], []
    # The unit's own sizes, plus one large message so the bandwidth term is resolved even when
    # latency dominates at the unit's sizes.
    sizes = sorted({max(64.0, unit_bytes / 16), unit_bytes, unit_bytes * 4, max(unit_bytes * 16, 4e6)})
    for name, (group, n) in groups.items():
        if n <= 1:
            continue
        for nbytes in sizes:
            numel = int(nbytes // 4) // n * n
            full = torch.ones(numel)
            shard = torch.empty(numel // n)
            ops = {
                "all_reduce": (lambda f=full, g=group: dist.all_reduce(f, group=g), 2.0),
                # The calls FSDP2 itself makes (torch 2.13: *_single).
                "reduce_scatter": (lambda s=shard, f=full, g=group: dist.reduce_scatter_single(s, f, group=g), 1.0),
                "all_gather": (lambda f=full, s=shard, g=group: dist.all_gather_single(f, s, group=g), 1.0),
            }
            for op, (run, factor) in ops.items():
                seconds = _time_collective(run, group, reps)
                rows.append([factor * (n - 1), factor * (n - 1) / n * numel * 4])
                measured.append({"group": name, "ranks": n, "op": op, "bytes": numel * 4, "seconds": seconds})
    if not rows:
        return {"alpha_s": 0.0, "bandwidth": math.inf, "points": measured, "rel_rms_error": 0.0}
    design, target = np.asarray(rows), np.asarray([m["seconds"] for m in measured])
    # Relative least squares (each point weighted by 1/t) so small and large messages both count.
    weights = 1 / np.maximum(target, 1e-9)
    (alpha, inv_bandwidth), *_ = np.linalg.lstsq(design * weights[:, None], target * weights, rcond=None)
    alpha, inv_bandwidth = max(float(alpha), 0.0), max(float(inv_bandwidth), 1e-15)
    fitted = design @ np.array([alpha, inv_bandwidth])
    for point, fit in zip(measured, fitted):
        point["fitted_s"] = float(fit)
    rel_rms = float(np.sqrt(np.mean(((fitted - target) / target) ** 2)))
    return {"alpha_s": alpha, "bandwidth": 1 / inv_bandwidth, "points": measured, "rel_rms_error": rel_rms}


def calibrate_compute(model: nn.Module, opts: SyncBenchOptions, clock: ComputeClock, device: torch.device,
                      generator: torch.Generator) -> dict:
    """Own compute seconds of one microbatch as a function of its cost: a + b·cost, fitted on every rank at once."""
    spec = opts.cost
    # Probe the costs the run will draw (bimodal), else around the mean; three distinct values for the fit.
    probe_costs = sorted({spec.short, spec.mean(), spec.long} if spec.distribution == "bimodal" and spec.ratio > 1
                         else {spec.short / 2, spec.short, spec.short * 2})
    probes, seconds = [], []
    for _ in range(3):
        for cost in probe_costs:
            costs = np.full(2, cost)
            inputs = [microbatch_inputs(opts, c, device, generator) for c in costs]
            for index, (x, _) in enumerate(accumulation(model, inputs, SYNC_POLICIES["final_only"])):
                clock.sleep_s = float(costs[index]) if opts.cost_model == "sleep" else 0.0
                before = clock.busy_s
                model(x).square().mean().backward()
                probes.append(cost)
                seconds.append(clock.busy_s - before)
            model.zero_grad(set_to_none=True)
    x_units = work_units(opts, np.asarray(probes))
    slope, intercept = np.polyfit(x_units, np.asarray(seconds), 1)
    return {"intercept_s": float(intercept), "slope_s_per_unit": float(slope),
            "probes": [[float(p), float(s)] for p, s in zip(x_units, seconds)]}


def costs_in_seconds(opts: SyncBenchOptions, costs: np.ndarray, compute: dict) -> np.ndarray:
    """Drawn costs as compute seconds through the fit of `calibrate_compute`."""
    return compute["intercept_s"] + compute["slope_s_per_unit"] * work_units(opts, costs)


def step_model(opts: SyncBenchOptions) -> Callable[..., np.ndarray]:
    """The simulator of the bench's step, (compute, replicate, shard, mode, workload, comm) -> step seconds:
    `simulate_step_times`, or under PP each replica group a pipeline running the bench's schedule."""
    if opts.pp == 1:
        return simulate_step_times
    order = schedule_order(opts.pp_schedule, opts.pp, opts.pp_stages_per_rank, opts.accum)

    def pipeline(compute: np.ndarray, replicate: int, shard: int, mode: str, workload: Workload,
                 comm: CommModel) -> np.ndarray:
        times = collective_times(mode, replicate, shard, workload, comm)
        return pipeline_step_times(compute, order, times, MODES[mode].flags, workload.layers,
                                   workload.forward_fraction).step_s

    return pipeline


def fit_per_call_overhead(opts: SyncBenchOptions, calibration: list, workload: Workload,
                          comm: CommModel) -> dict[str, float]:
    """Seconds of FSDP bookkeeping per collective call, per mesh, from the zero-variance calibration steps.

    With equal costs the simulated step is linear in the per-call overhead o:
    t_mode = t_mode(o=0) + calls_mode · o. Each mode's repeats are reduced to their median
    (a shared machine throws outliers), then least squares over the modes of one mesh
    ("1d": fsdp over the whole world, "2d": the HSDP modes); separate because a
    collective over every process of an oversubscribed host costs more than one over a
    pair, beyond what the alpha-beta terms say.
    """
    simulate = step_model(opts)
    by_mode: dict[str, list[tuple[float, float]]] = {}
    for mode, step_s, compute_per_microbatch in calibration:
        by_mode.setdefault(mode, []).append((step_s, compute_per_microbatch))
    calls: dict[str, list[float]] = {}
    excess: dict[str, list[float]] = {}
    for mode, repeats in by_mode.items():
        step_s, compute_per_microbatch = (float(v) for v in np.median(np.asarray(repeats), axis=0))
        compute = np.full((1, opts.accum, opts.replicate), compute_per_microbatch)
        base = simulate(compute, opts.replicate, opts.shard, mode, workload, comm)[0]
        with_one = simulate(compute, opts.replicate, opts.shard, mode, replace(workload, per_call_overhead_s=1.0),
                            comm)[0]
        mesh = MODES[mode].mesh
        calls.setdefault(mesh, []).append(with_one - base)
        excess.setdefault(mesh, []).append(step_s - base)
    fitted = {}
    for mesh in calls:
        x, y = np.asarray(calls[mesh]), np.asarray(excess[mesh])
        fitted[mesh] = max(0.0, float(x @ y / max(x @ x, 1e-12)))
    return fitted
