"""`moetrain bench sync`: data-parallel sync policies under inhomogeneous microbatches, measured.

One invocation runs every mode on the same per-(step, microbatch, replica group) costs
(moetrain.bench.costs), interleaved: step k's costs run once in each mode, in an order
rotated with k, so slow drift of a shared machine hits all modes alike and every step
gives one paired comparison. Modes: `fsdp` (1-D mesh over all ranks, gradients
reduce-scattered every microbatch), `hsdp` (replicate x shard, all-reduce every
microbatch), `hsdp-delayed` (all-reduce on the final microbatch only) and
`hsdp-final-only` (no gradient sync until the final microbatch). The FSDP flags come
from `moetrain.parallel.grad_sync` (the one place the project sets them).

Cost models: `sleep` (a small MLP plus a sleep of the drawn seconds, spread over the
units' forward and backward like real compute: isolates synchronisation from CPU
contention), `batch` (real compute; the drawn cost is the microbatch's sample count),
`packed` (moetrain's Transformer on equal-token microbatches whose document length is
the drawn cost). Each rank also times its own compute (the sleep and layer math, not
FSDP's collectives), so "collective wait" = step time - own compute.

The same run calibrates the simulator: an alpha-beta fit of gloo/NCCL all-reduce,
reduce-scatter and all-gather timings on the bench's own process groups, the compute
seconds of a microbatch as a function of its cost, and a per-call FSDP overhead from
zero-variance steps interleaved with the measured ones. `predicted` is
`moetrain.bench.simulate` on exactly the drawn costs. Started without torchrun it
spawns its own ranks.

The bench is split by job, each module importing only those before it: `sync_options`
(options, mode table, validation) <- `sync_model` (instrumented networks, microbatch
inputs) <- `sync_calibration` (alpha-beta, compute and overhead fits) <- `sync_report`
(statistics, text, JSON, charts) <- this module (the run on every rank and `main`).
The bench measures; it must not change how training syncs.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moetrain.args import parse_typed_args
from moetrain.bench.costs import draw_costs, replica_group_of
from moetrain.bench.sync_calibration import calibrate_comm, calibrate_compute
from moetrain.bench.sync_model import ComputeClock, build_model, microbatch_inputs
from moetrain.bench.sync_options import MODE_SETUP, SyncBenchOptions, validate_options
from moetrain.bench.sync_pipeline import build_pipeline, run_pipeline_step
from moetrain.bench.sync_report import RESULTS_DIR, report, summarize_runs
from moetrain.config.parallel import ParallelConfig
from moetrain.errors import ConfigError
from moetrain.parallel.grad_sync import SYNC_POLICIES, SyncPolicy, accumulation
from moetrain.parallel.mesh import JobMesh
from moetrain.parallel.process_group import init_distributed
from moetrain.parallel.shard import apply_fsdp
from moetrain.testing import run_on_ranks


def _run_step(model: nn.Module, policy: SyncPolicy, opts: SyncBenchOptions, clock: ComputeClock, costs: np.ndarray,
              device: torch.device, generator: torch.Generator) -> tuple[float, float, list[float]]:
    """One optimizer step's forward/backward passes; returns (step s, own compute s, compute s per microbatch)."""
    inputs = [microbatch_inputs(opts, cost, device, generator) for cost in costs]
    per_microbatch = []
    clock.busy_s = 0.0
    dist.barrier()
    start = time.perf_counter()
    for index, (x, _) in enumerate(accumulation(model, inputs, policy)):
        before = clock.busy_s
        clock.sleep_s = float(costs[index]) if opts.cost_model == "sleep" else 0.0
        model(x).square().mean().backward()
        per_microbatch.append(clock.busy_s - before)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed, clock.busy_s, per_microbatch


def _gather_floats(values: list[float], world_size: int, device: torch.device) -> np.ndarray:
    """Every rank's `values` as a [world_size, len(values)] array (one all-gather, on every rank)."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    out = torch.empty(world_size * len(values), dtype=torch.float64, device=device)
    dist.all_gather_single(out, local)
    return out.view(world_size, len(values)).cpu().numpy()


def _build_modes(opts: SyncBenchOptions, clock: ComputeClock, world_size: int, device: torch.device,
                 generator: torch.Generator) -> tuple[dict[str, JobMesh], Callable]:
    """Each mesh the modes need, and `run(mode, costs)`: one step of that mode (through the schedule under PP)."""
    meshes, runners = {}, {}
    # A list, not a set: every rank must create the meshes (collective calls) in the same order,
    # and string hashing differs between processes.
    for replicate in dict.fromkeys(MODE_SETUP[m][0] for m in opts.modes):
        setup = next(MODE_SETUP[m] for m in opts.modes if MODE_SETUP[m][0] == replicate)
        if opts.pp > 1:
            meshes[replicate], schedule, stages = build_pipeline(opts, clock, setup, world_size, device)
            runners[replicate] = functools.partial(_run_pipeline_mode, schedule, stages)
            continue
        size = opts.replicate if replicate == "R" else 1
        parallel = ParallelConfig(dp_replicate=size, dp_shard=world_size // size)
        meshes[replicate] = JobMesh.from_config(parallel, world_size, device)
        model = apply_fsdp(build_model(opts, clock, opts.seed).to(device), meshes[replicate], parallel)
        runners[replicate] = functools.partial(_run_step, model)

    def run(mode: str, costs: np.ndarray) -> tuple[float, float, list[float]]:
        replicate, policy = MODE_SETUP[mode]
        return runners[replicate](SYNC_POLICIES[policy], opts, clock, costs, device, generator)

    return meshes, run


def _run_pipeline_mode(schedule, stages, policy: SyncPolicy, *args) -> tuple[float, float, list[float]]:
    for stage in stages:
        stage.policy = policy
    return run_pipeline_step(schedule, stages, *args)


def run_ranks(opts: SyncBenchOptions) -> dict | None:
    """The per-rank benchmark; rank 0 returns the raw measurements, other ranks None."""
    rank, world_size, device = init_distributed(ParallelConfig())
    if world_size != opts.pp * opts.replicate * opts.shard:
        raise ConfigError(f"pp x replicate x shard = {opts.pp} x {opts.replicate} x {opts.shard} must equal the "
                          f"world size {world_size}")
    clock = ComputeClock(layers=opts.layers)
    generator = torch.Generator().manual_seed(opts.seed * 1000 + rank)
    meshes, run = _build_modes(opts, clock, world_size, device, generator)
    whole_model = build_model(opts, clock, opts.seed).to(device)
    param_bytes = sum(p.numel() for p in whole_model.parameters()) * 4

    # The 1-D FSDP group: the whole world, or under PP the data-parallel ranks of this pipeline rank.
    groups = {"world": (dist.group.WORLD, world_size)} if opts.pp == 1 else {}
    if opts.pp > 1 and "1" in meshes:
        groups["data"] = (meshes["1"].fsdp.get_group(), opts.replicate * opts.shard)
    if "R" in meshes:
        mesh = meshes["R"].data
        groups["dp_shard"] = (mesh.get_group("dp_shard"), opts.shard)
        groups["dp_replicate"] = (mesh.get_group("dp_replicate"), opts.replicate)
    comm = calibrate_comm(groups, param_bytes / opts.layers)

    # Under PP the replica group is the data-parallel coordinate (ranks are pp-major).
    group = replica_group_of(rank % (opts.replicate * opts.shard), opts.shard)
    zero_variance = np.full(opts.accum, opts.cost.short)
    for mode in opts.modes:  # absorbs FSDP's lazy initialisation
        run(mode, zero_variance)
    # The whole model's compute per microbatch (unsharded: no collectives); a stage does its share of it.
    compute = calibrate_compute(whole_model, opts, clock, device, generator)
    all_costs = draw_costs(opts.cost, opts.seed, opts.warmup_steps + opts.steps, opts.accum, opts.replicate)
    n_modes = len(opts.modes)
    # Zero-variance steps (every group the short cost: nobody waits for anybody) fit the
    # per-call FSDP overhead. They are spread over the measured blocks, cycling through the
    # modes, so they see the same load of a shared machine as the measurement; at least
    # three per mode.
    calibration_modes = [opts.modes[i % n_modes] for i in range(max(opts.steps, 3 * n_modes))]
    per_block = math.ceil(len(calibration_modes) / opts.steps)
    records = []  # (step, mode, [per rank: step s, compute s, compute s per microbatch...])
    overhead_calibration = []  # (mode, step s, own compute s per microbatch)
    for k, costs in enumerate(all_costs):
        order = [opts.modes[(k + i) % n_modes] for i in range(n_modes)]  # rotate: no mode always runs first
        for mode in order:
            elapsed, busy, per_microbatch = run(mode, costs[:, group])
            gathered = _gather_floats([elapsed, busy, *per_microbatch], world_size, device)
            if k >= opts.warmup_steps:
                records.append((k - opts.warmup_steps, mode, gathered))
        if k < opts.warmup_steps:
            continue
        block = k - opts.warmup_steps
        for mode in calibration_modes[block * per_block:(block + 1) * per_block]:
            elapsed, busy, _ = run(mode, zero_variance)
            gathered = _gather_floats([elapsed, busy], world_size, device)
            overhead_calibration.append((mode, float(gathered[:, 0].max()), float(gathered[:, 1].mean() / opts.accum)))
    if rank != 0:
        return None
    return {"records": records, "costs": all_costs[opts.warmup_steps:], "comm": comm, "compute": compute,
            "overhead_calibration": overhead_calibration,
            "param_bytes": param_bytes, "world_size": world_size, "backend": dist.get_backend(),
            "device": device.type, "threads_per_rank": torch.get_num_threads()}


def main(argv: list[str]) -> int:
    opts: SyncBenchOptions = parse_typed_args(SyncBenchOptions, argv, "moetrain bench sync")
    if opts.summarize:
        figure = str(RESULTS_DIR / "sync_summary.png") if opts.figure == "auto" else opts.figure
        print(summarize_runs(opts.summarize, figure))
        return 0
    validate_options(opts)
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        raw = run_ranks(opts)
        if raw is not None:
            report(opts, raw)
        return 0
    results = run_on_ranks(run_ranks, opts.pp * opts.replicate * opts.shard, opts, timeout=opts.timeout_s)
    report(opts, results[0])
    return 0
