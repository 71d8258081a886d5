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
spawns its own ranks. This module measures; it must not change how training syncs.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np

from moetrain.bench.costs import CostSpec, as_batch_sizes, draw_costs, replica_group_of
from moetrain.bench.simulate import MODES, CommModel, Link, Workload, simulate_step_times
from moetrain.config import ConfigError, parse_typed_args

RESULTS_DIR = Path("benchmarks/results")
# bench mode -> (dp_replicate of the mesh it runs on: "R" = the bench's replicate size, or 1; grad_sync policy)
MODE_SETUP: dict[str, tuple[str, str]] = {
    "fsdp": ("1", "every_microbatch"),
    "hsdp": ("R", "every_microbatch"),
    "hsdp-delayed": ("R", "delayed_all_reduce"),
    "hsdp-final-only": ("R", "final_only"),
}
REFERENCE = "hsdp-delayed"


@dataclass
class SyncBenchOptions:
    """Compare fsdp / hsdp / hsdp-delayed / hsdp-final-only step times on identical drawn microbatch costs."""

    cost_model: Literal["sleep", "batch", "packed"] = "sleep"
    # sleep: seconds of compute per microbatch; batch: samples per microbatch (rounded, >= 1);
    # packed: tokens per document of the microbatch's packed sequence (rounded, >= 1).
    cost: CostSpec = field(default_factory=lambda: CostSpec("bimodal", 0.04, 4.0, 0.5))
    replicate: int = 2  # replica groups (dp_replicate)
    shard: int = 2  # ranks per replica group (dp_shard)
    accum: int = 4  # microbatches per optimizer step
    steps: int = 16  # measured cost draws; each runs once in every mode
    warmup_steps: int = 1  # extra draws run first in every mode and discarded
    modes: tuple[str, ...] = tuple(MODE_SETUP)
    layers: int = 4  # FSDP units of the benchmark MLP
    dim: int = 64  # model width
    hidden: int = 256  # MLP / feed-forward hidden width
    seq_len: int = 16  # tokens per sample (sleep, batch)
    microbatch_size: int = 2  # samples per microbatch in the sleep model
    packed_tokens: int = 2048  # packed: tokens per microbatch (documents x document length, about this many)
    heads: int = 2  # packed: attention heads of the moetrain Transformer
    seed: int = 0
    bootstrap: int = 2000  # paired bootstrap resamples for confidence intervals
    json: str | None = None
    figure: str | None = "auto"  # PNG path; "auto" = benchmarks/results/sync_<model>_<dist>_<R>x<S>_acc<A>.png; "none"
    timeout_s: float = 1200.0  # spawned ranks only: fail instead of hanging
    # Instead of running: read these bench JSON files, print a markdown table of measured vs
    # predicted ratios and draw them into --figure (default benchmarks/results/sync_summary.png).
    summarize: tuple[str, ...] = ()


def _validate(opts: SyncBenchOptions) -> None:
    for name in ("replicate", "shard", "accum", "steps", "layers", "dim", "hidden", "seq_len", "microbatch_size",
                 "packed_tokens", "heads", "bootstrap"):
        if getattr(opts, name) < 1:
            raise ConfigError(f"{name} = {getattr(opts, name)!r} is invalid: must be a positive integer")
    if opts.warmup_steps < 0:
        raise ConfigError(f"warmup_steps = {opts.warmup_steps!r} is invalid: must be >= 0")
    if opts.cost_model not in ("sleep", "batch", "packed"):
        raise ConfigError(f"cost_model = {opts.cost_model!r} is invalid: valid are ('sleep', 'batch', 'packed')")
    if opts.cost_model == "packed" and (opts.dim % opts.heads or (opts.dim // opts.heads) % 2):
        raise ConfigError(f"heads = {opts.heads} is invalid: dim / heads must be an even integer (dim = {opts.dim})")
    unknown = [m for m in opts.modes if m not in MODE_SETUP]
    if unknown or not opts.modes:
        raise ConfigError(f"modes {list(opts.modes)} are invalid: choose from {tuple(MODE_SETUP)}")
    if REFERENCE not in opts.modes:
        raise ConfigError(f"modes {list(opts.modes)} must include {REFERENCE!r} (ratios are relative to it)")
    opts.cost.validate()


# ----------------------------------------------------------------------------- the benchmark model


@dataclass
class ComputeClock:
    """This rank's compute: the drawn sleep of the current microbatch and the time spent computing.

    Blocks time the stretch between entering and leaving their own math, forward and
    backward, so FSDP's hooks (all-gather before, reduce-scatter/all-reduce after) fall
    outside it.
    """

    sleep_s: float = 0.0  # drawn seconds of the current microbatch (sleep model)
    forward_fraction: float = 1 / 3
    layers: int = 1
    busy_s: float = 0.0
    _entered: float | None = None

    def enter(self) -> None:
        self._entered = time.perf_counter()

    def leave(self) -> None:
        if self._entered is not None:
            self.busy_s += time.perf_counter() - self._entered
            self._entered = None

    def sleep_share(self, backward: bool) -> float:
        share = (1 - self.forward_fraction) if backward else self.forward_fraction
        return self.sleep_s * share / self.layers


def _timed_block_functions():
    import torch

    class Enter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, clock):
            ctx.clock = clock
            clock.enter()
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            ctx.clock.leave()  # backward runs last through the block's entry
            return grad, None

    class Leave(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, clock):
            ctx.clock = clock
            clock.leave()
            return x.clone()  # not a view: FSDP registers its pre-backward hook on the block's output

        @staticmethod
        def backward(ctx, grad):
            ctx.clock.enter()  # backward enters the block here
            return grad, None

    class Sleep(torch.autograd.Function):
        """Stands in for compute: sleeps its share of the drawn cost in forward and in backward."""

        @staticmethod
        def forward(ctx, x, clock):
            ctx.clock = clock
            time.sleep(clock.sleep_share(backward=False))
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ctx.clock.sleep_share(backward=True))
            return grad, None

    return Enter, Leave, Sleep


PACKED_VOCAB = 259


def build_packed_model(opts: SyncBenchOptions, clock: ComputeClock, seed: int):
    """moetrain's Transformer (dense blocks: the MoE router would add its own cost noise), instrumented.

    The clock enters at the input of each block's attention norm (after FSDP's all-gather)
    and leaves at the output of its feed-forward (before FSDP's post-forward); in
    backward the same two points bracket the block's math, with FSDP's pre-backward
    all-gather before and its reduce-scatter after.
    """
    from moetrain.config import ModelConfig
    from moetrain.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=PACKED_VOCAB, dim=opts.dim, n_layers=opts.layers, n_heads=opts.heads,
                      ffn_hidden=opts.hidden, n_dense_layers=opts.layers, max_seq_len=opts.packed_tokens)
    model = Transformer(cfg)
    model.init_weights(seed=seed)
    enter, leave, _ = _timed_block_functions()
    for layer in model.layers:
        layer.attention_norm.register_forward_pre_hook(lambda module, args: (enter.apply(args[0], clock),))
        layer.feed_forward.register_forward_hook(lambda module, args, out: leave.apply(out, clock))
    return model


def build_model(opts: SyncBenchOptions, clock: ComputeClock, seed: int):
    """The cost model's network with `.layers` (one FSDP unit each), instrumented by `clock`."""
    import torch
    from torch import nn

    if opts.cost_model == "packed":
        return build_packed_model(opts, clock, seed)
    enter, leave, sleep = _timed_block_functions()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(opts.dim, opts.hidden)
            self.down = nn.Linear(opts.hidden, opts.dim)

        def forward(self, x):
            x = enter.apply(x, clock)
            x = sleep.apply(x, clock)
            x = x + self.down(torch.nn.functional.gelu(self.up(x)))
            return leave.apply(x, clock)

    class SyncBenchMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(opts.layers))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(seed)
    return SyncBenchMLP()


# ----------------------------------------------------------------------------- calibration


def _time_collective(run, group, reps: int) -> float:
    import torch.distributed as dist

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
    import torch
    import torch.distributed as dist

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


# ----------------------------------------------------------------------------- the ranks


def packed_shape(opts: SyncBenchOptions, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(documents, tokens per document) of packed microbatches whose documents are `cost` tokens long.

    Every document of one microbatch has the drawn length, so the microbatch is a
    [documents, length] batch with causal attention inside each row: exactly a packed
    sequence with document masking, at about `packed_tokens` tokens whatever the mix,
    but with attention cost growing with the document length.
    """
    length = np.minimum(as_batch_sizes(np.asarray(cost)), opts.packed_tokens)
    return np.maximum(opts.packed_tokens // length, 1), length


def work_units(opts: SyncBenchOptions, costs: np.ndarray) -> np.ndarray:
    """What a microbatch's compute scales with: seconds (sleep), samples (batch), document length (packed)."""
    if opts.cost_model == "batch":
        return as_batch_sizes(costs).astype(float)
    if opts.cost_model == "packed":
        return packed_shape(opts, costs)[1].astype(float)
    return np.asarray(costs, dtype=float)


def items_per_microbatch(opts: SyncBenchOptions, costs: np.ndarray) -> np.ndarray:
    """Throughput units per rank and microbatch: samples (sleep, batch) or tokens (packed)."""
    if opts.cost_model == "batch":
        return as_batch_sizes(costs)
    if opts.cost_model == "packed":
        documents, length = packed_shape(opts, costs)
        return documents * length
    return np.full(np.shape(costs), opts.microbatch_size)


def _microbatch_inputs(opts: SyncBenchOptions, cost: float, device, generator):
    import torch

    if opts.cost_model == "packed":
        documents, length = packed_shape(opts, np.array(cost))
        return torch.randint(0, PACKED_VOCAB, (int(documents), int(length)), generator=generator).to(device)
    samples = int(as_batch_sizes(np.array(cost))) if opts.cost_model == "batch" else opts.microbatch_size
    # requires_grad: the first block's backward (and its share of the sleep) must run too.
    return torch.randn(samples, opts.seq_len, opts.dim, generator=generator).to(device).requires_grad_(True)


def _run_step(model, policy, opts: SyncBenchOptions, clock: ComputeClock, costs: np.ndarray, device,
              generator) -> tuple[float, float, list[float]]:
    """One optimizer step's forward/backward passes; returns (step s, own compute s, compute s per microbatch)."""
    import torch
    import torch.distributed as dist

    from moetrain.parallel.grad_sync import accumulation

    inputs = [_microbatch_inputs(opts, cost, device, generator) for cost in costs]
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


def _calibrate_compute(model, opts: SyncBenchOptions, clock: ComputeClock, device, generator) -> dict:
    """Own compute seconds of one microbatch as a function of its cost: a + b·cost, fitted on every rank at once."""
    from moetrain.parallel.grad_sync import SYNC_POLICIES, accumulation

    spec = opts.cost
    # Probe the costs the run will draw (bimodal), else around the mean; three distinct values for the fit.
    probe_costs = sorted({spec.short, spec.mean(), spec.long} if spec.distribution == "bimodal" and spec.ratio > 1
                         else {spec.short / 2, spec.short, spec.short * 2})
    probes, seconds = [], []
    for _ in range(3):
        for cost in probe_costs:
            costs = np.full(2, cost)
            inputs = [_microbatch_inputs(opts, c, device, generator) for c in costs]
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


def _gather_floats(values: list[float], world_size: int, device) -> np.ndarray:
    import torch
    import torch.distributed as dist

    local = torch.tensor(values, dtype=torch.float64, device=device)
    out = torch.empty(world_size * len(values), dtype=torch.float64, device=device)
    dist.all_gather_single(out, local)
    return out.view(world_size, len(values)).cpu().numpy()


def run_ranks(opts: SyncBenchOptions) -> dict | None:
    """The per-rank benchmark; rank 0 returns the raw measurements, other ranks None."""
    import torch
    import torch.distributed as dist

    from moetrain.config import ParallelConfig
    from moetrain.parallel.grad_sync import SYNC_POLICIES
    from moetrain.parallel.mesh import build_mesh, init_distributed
    from moetrain.parallel.shard import apply_fsdp

    rank, world_size, device = init_distributed(ParallelConfig())
    if world_size != opts.replicate * opts.shard:
        raise ConfigError(f"replicate x shard = {opts.replicate} x {opts.shard} must equal the world size "
                          f"{world_size}")
    clock = ComputeClock(layers=opts.layers)
    meshes, models = {}, {}
    # A list, not a set: every rank must create the meshes (collective calls) in the same order,
    # and string hashing differs between processes.
    for replicate in dict.fromkeys(MODE_SETUP[m][0] for m in opts.modes):
        size = opts.replicate if replicate == "R" else 1
        parallel = ParallelConfig(dp_replicate=size, dp_shard=world_size // size)
        meshes[replicate] = build_mesh(parallel, world_size, device.type)
        model = build_model(opts, clock, opts.seed).to(device)
        models[replicate] = apply_fsdp(model, meshes[replicate], parallel)
    param_bytes = sum(p.numel() for p in build_model(opts, clock, opts.seed).parameters()) * 4

    groups = {"world": (dist.group.WORLD, world_size)}
    if "R" in meshes:
        mesh = meshes["R"]
        groups["dp_shard"] = (mesh.get_group("dp_shard"), opts.shard)
        groups["dp_replicate"] = (mesh.get_group("dp_replicate"), opts.replicate)
    comm = calibrate_comm(groups, param_bytes / opts.layers)
    generator = torch.Generator().manual_seed(opts.seed * 1000 + rank)

    group = replica_group_of(rank, opts.shard)
    zero_variance = np.full(opts.accum, opts.cost.short)

    def run(mode: str, costs: np.ndarray) -> tuple[float, float, list[float]]:
        model, policy = models[MODE_SETUP[mode][0]], SYNC_POLICIES[MODE_SETUP[mode][1]]
        return _run_step(model, policy, opts, clock, costs, device, generator)

    for mode in opts.modes:  # absorbs FSDP's lazy initialisation
        run(mode, zero_variance)
    compute = _calibrate_compute(models[next(iter(models))], opts, clock, device, generator)
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


# ----------------------------------------------------------------------------- statistics and report


def bootstrap_ratio_ci(step_s: dict[str, np.ndarray], reference: str, resamples: int, seed: int,
                       stat=np.mean) -> dict[str, tuple[float, float, float]]:
    """stat(mode) / stat(reference) with a 95% paired bootstrap interval over steps (blocks).

    Step k of every mode ran on the same costs in the same block, so resampling step
    indices keeps the pairs together.
    """
    rng = np.random.default_rng(seed)
    n = len(step_s[reference])
    index = rng.integers(0, n, size=(resamples, n))
    out = {}
    for mode, times in step_s.items():
        point = float(stat(times) / stat(step_s[reference]))
        boot = stat(times[index], axis=1) / stat(step_s[reference][index], axis=1)
        low, high = np.percentile(boot, [2.5, 97.5])
        out[mode] = (point, float(low), float(high))
    return out


def costs_in_seconds(opts: SyncBenchOptions, costs: np.ndarray, compute: dict) -> np.ndarray:
    return compute["intercept_s"] + compute["slope_s_per_unit"] * work_units(opts, costs)


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
    by_mode: dict[str, list[tuple[float, float]]] = {}
    for mode, step_s, compute_per_microbatch in calibration:
        by_mode.setdefault(mode, []).append((step_s, compute_per_microbatch))
    calls: dict[str, list[float]] = {}
    excess: dict[str, list[float]] = {}
    for mode, repeats in by_mode.items():
        step_s, compute_per_microbatch = (float(v) for v in np.median(np.asarray(repeats), axis=0))
        compute = np.full((1, opts.accum, opts.replicate), compute_per_microbatch)
        base = simulate_step_times(compute, opts.replicate, opts.shard, mode, workload, comm)[0]
        with_one = simulate_step_times(compute, opts.replicate, opts.shard, mode,
                                       replace(workload, per_call_overhead_s=1.0), comm)[0]
        mesh = MODES[mode].mesh
        calls.setdefault(mesh, []).append(with_one - base)
        excess.setdefault(mesh, []).append(step_s - base)
    fitted = {}
    for mesh in calls:
        x, y = np.asarray(calls[mesh]), np.asarray(excess[mesh])
        fitted[mesh] = max(0.0, float(x @ y / max(x @ x, 1e-12)))
    return fitted


def summarise(opts: SyncBenchOptions, raw: dict) -> dict:
    steps, modes = opts.steps, list(opts.modes)
    step_s = {m: np.zeros(steps) for m in modes}
    wait_s = {m: np.zeros(steps) for m in modes}
    measured_compute = np.zeros((steps, opts.accum, opts.replicate))
    for k, mode, gathered in raw["records"]:
        step_s[mode][k] = gathered[:, 0].max()  # the step ends when its last rank does
        wait_s[mode][k] = float(np.mean(gathered[:, 0] - gathered[:, 1]))
        if mode == REFERENCE:
            per_rank = gathered[:, 2:]  # [world, accum]
            measured_compute[k] = per_rank.reshape(opts.replicate, opts.shard, opts.accum).mean(axis=1).T
    costs = raw["costs"]
    samples = items_per_microbatch(opts, costs).sum(axis=(1, 2)) * opts.shard
    comm = CommModel(intra=Link(raw["comm"]["alpha_s"], raw["comm"]["bandwidth"]),
                     inter=Link(raw["comm"]["alpha_s"], raw["comm"]["bandwidth"]),
                     ranks_per_node=raw["world_size"], algorithm="ring")
    workload = Workload(layers=opts.layers, grad_bytes=raw["param_bytes"], overlap="blocking",
                        reshard_after_forward=True, forward_fraction=1 / 3)
    overhead = fit_per_call_overhead(opts, raw["overhead_calibration"], workload, comm)
    workloads = {m: replace(workload, per_call_overhead_s=overhead[MODES[m].mesh]) for m in modes}
    drawn_seconds = costs_in_seconds(opts, costs, raw["compute"])
    predicted = {m: simulate_step_times(drawn_seconds, opts.replicate, opts.shard, m, workloads[m], comm)
                 for m in modes}
    from_trace = {m: simulate_step_times(measured_compute, opts.replicate, opts.shard, m, workloads[m], comm)
                  for m in modes}
    mean_ci = bootstrap_ratio_ci(step_s, REFERENCE, opts.bootstrap, opts.seed)
    median_ci = bootstrap_ratio_ci(step_s, REFERENCE, opts.bootstrap, opts.seed, stat=np.median)
    rows = []
    for m in modes:
        rows.append({
            "mode": m, "median_step_s": float(np.median(step_s[m])), "p90_step_s": float(np.percentile(step_s[m], 90)),
            "mean_step_s": float(step_s[m].mean()),
            "samples_per_s": float(samples.sum() / step_s[m].sum()),
            "collective_wait_s": float(np.median(wait_s[m])),
            "ratio_mean_to_ref": mean_ci[m][0], "ratio_mean_ci95": list(mean_ci[m][1:]),
            "ratio_median_to_ref": median_ci[m][0], "ratio_median_ci95": list(median_ci[m][1:]),
            "predicted_median_step_s": float(np.median(predicted[m])),
            "predicted_mean_step_s": float(predicted[m].mean()),
            "predicted_ratio_mean_to_ref": float(predicted[m].mean() / predicted[REFERENCE].mean()),
            "trace_predicted_ratio_mean_to_ref": float(from_trace[m].mean() / from_trace[REFERENCE].mean()),
            "step_s": step_s[m].tolist(),
        })
    return {
        "command": "moetrain bench sync",
        "options": asdict(opts),
        "environment": {"backend": raw["backend"], "device": raw["device"], "world_size": raw["world_size"],
                        "cpu_cores": os.cpu_count(), "threads_per_rank": raw["threads_per_rank"]},
        "modes": rows,
        "predicted": {m: float(np.median(predicted[m])) for m in modes},
        "predicted_mean": {m: float(predicted[m].mean()) for m in modes},
        "calibration": {"comm": raw["comm"], "compute": raw["compute"], "param_bytes": raw["param_bytes"],
                        "per_call_overhead_s": overhead,
                        "zero_variance_steps": [{"mode": m, "step_s": t, "compute_per_microbatch_s": c}
                                                for m, t, c in raw["overhead_calibration"]]},
        "costs": costs.tolist(),
        "costs_s": drawn_seconds.tolist(),
        "measured_compute_s": measured_compute.tolist(),
    }


def format_report(result: dict) -> str:
    opts, env = result["options"], result["environment"]
    cost = opts["cost"]
    lines = [f"moetrain bench sync: cost_model={opts['cost_model']} {cost['distribution']} "
             f"(short {cost['short']:g}, ratio {cost['ratio']:g}, p_long {cost['p_long']:g}, cv {cost['cv']:g}), "
             f"{opts['replicate']} replica groups x {opts['shard']} shards, accum {opts['accum']}, "
             f"{opts['steps']} interleaved steps per mode, seed {opts['seed']}",
             f"{env['world_size']} ranks on {env['device']} ({env['backend']}), {env['cpu_cores']} CPU cores, "
             f"{env['threads_per_rank']} thread(s) per rank"]
    if opts["cost_model"] == "sleep" and env["device"] == "cpu":
        lines.append(f"note: {env['world_size']} ranks share {env['cpu_cores']} cores; the sleep cost model "
                     "isolates synchronisation effects from CPU contention.")
    elif env["device"] == "cpu":
        lines.append(f"note: {env['world_size']} ranks share {env['cpu_cores']} cores: real compute contends, "
                     "so a waiting rank lends its core to the others.")
    comm = result["calibration"]["comm"]
    bandwidth = f"{comm['bandwidth'] / 1e6:.0f} MB/s" if comm["bandwidth"] < 1e12 else "unresolved (latency-bound)"
    lines.append(f"alpha-beta fit on this run's groups: alpha {comm['alpha_s'] * 1e6:.0f} us, "
                 f"bandwidth {bandwidth} (relative rms error {comm['rel_rms_error']:.2f}); "
                 "FSDP overhead per collective call (fitted on zero-variance steps): "
                 + ", ".join(f"{mesh} mesh {o * 1e3:.2f} ms"
                             for mesh, o in result['calibration']['per_call_overhead_s'].items()))
    unit = "tokens/s" if opts["cost_model"] == "packed" else "samples/s"
    header = (f"{'mode':<16} {'median s':>9} {'p90 s':>8} {unit:>10} {'coll wait':>9} "
              f"{'mean / delayed [95% CI]':>26} {'pred':>6} {'median / delayed [95% CI]':>27} {'pred med s':>10}")
    lines.append(header)
    for row in result["modes"]:
        lo, hi = row["ratio_mean_ci95"]
        mlo, mhi = row["ratio_median_ci95"]
        lines.append(f"{row['mode']:<16} {row['median_step_s']:>9.3f} {row['p90_step_s']:>8.3f} "
                     f"{row['samples_per_s']:>10.1f} {row['collective_wait_s']:>9.3f} "
                     f"{row['ratio_mean_to_ref']:>8.3f} [{lo:.3f}, {hi:.3f}]{'':>3} "
                     f"{row['predicted_ratio_mean_to_ref']:>6.3f} "
                     f"{row['ratio_median_to_ref']:>9.3f} [{mlo:.3f}, {mhi:.3f}]{'':>3} "
                     f"{row['predicted_median_step_s']:>10.3f}")
    lines.append("ratios > 1: slower than hsdp-delayed (mean ratio = throughput ratio); pred = simulator on the "
                 "same drawn costs; coll wait = median step time minus own compute, averaged over ranks.")
    return "\n".join(lines)


def draw_chart(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["modes"]
    names = [r["mode"] for r in rows]
    ratios = [r["ratio_mean_to_ref"] for r in rows]
    errors = np.array([[r["ratio_mean_to_ref"] - r["ratio_mean_ci95"][0], r["ratio_mean_ci95"][1]
                        - r["ratio_mean_to_ref"]] for r in rows]).T
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = np.arange(len(rows))
    ax.bar(xs, ratios, yerr=errors, capsize=5, color="#6d9dc5", label="measured (95% paired bootstrap CI)")
    ax.scatter(xs, [r["predicted_ratio_mean_to_ref"] for r in rows], color="#c0392b", zorder=3, marker="D",
               label="simulator, same drawn costs")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(xs, names)
    ax.set_ylabel("mean step time / hsdp-delayed")
    ax.set_title(f"bench sync: {_setting_label(result)} ({result['options']['steps']} steps)", fontsize=10)
    low = min(min(ratios), min(r["predicted_ratio_mean_to_ref"] for r in rows))
    ax.set_ylim(max(0.0, low - 0.15), None)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _default_figure_path(opts: SyncBenchOptions) -> str:
    return str(RESULTS_DIR / f"sync_{opts.cost_model}_{opts.cost.distribution}_{opts.replicate}x{opts.shard}"
                             f"_acc{opts.accum}.png")


def report(opts: SyncBenchOptions, raw: dict) -> dict:
    result = summarise(opts, raw)
    figure = _default_figure_path(opts) if opts.figure == "auto" else opts.figure
    if figure and figure != "none":
        draw_chart(result, figure)
        result["figure"] = figure
    print(format_report(result))
    if figure and figure != "none":
        print(f"figure: {figure}")
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"json: {opts.json}")
    return result


def _setting_label(result: dict) -> str:
    opts, cost = result["options"], result["options"]["cost"]
    shape = {"bimodal": f"bimodal {cost['short']:g}/{cost['short'] * cost['ratio']:g} p={cost['p_long']:g}",
             "lognormal": f"lognormal mean {cost['short']:g} cv {cost['cv']:g}",
             "constant": f"constant {cost['short']:g}"}[cost["distribution"]]
    return f"{opts['cost_model']} {shape}, {opts['replicate']}x{opts['shard']}, acc {opts['accum']}"


def summarize_runs(paths: tuple[str, ...], figure: str | None) -> str:
    """Markdown table (and chart) of measured vs predicted step-time ratios over several bench runs."""
    results = []
    for path in paths:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"summarize: {path!r} does not exist")
        try:
            results.append(json.loads(file.read_text()))
        except ValueError as err:
            raise ConfigError(f"summarize: {path!r} is not JSON ({err})") from None
    lines = ["| setting | mode | measured / hsdp-delayed [95% CI] | simulator | error |",
             "|---|---|---|---|---|"]
    labels, measured, low, high, predicted = [], [], [], [], []
    for result in results:
        for row in result["modes"]:
            if row["mode"] == REFERENCE:
                continue
            lo, hi = row["ratio_mean_ci95"]
            error = row["predicted_ratio_mean_to_ref"] / row["ratio_mean_to_ref"] - 1
            lines.append(f"| {_setting_label(result)} | {row['mode']} | {row['ratio_mean_to_ref']:.3f} "
                         f"[{lo:.3f}, {hi:.3f}] | {row['predicted_ratio_mean_to_ref']:.3f} | {error:+.1%} |")
            if row["mode"] == "hsdp":
                labels.append(_setting_label(result).replace(", ", "\n").replace(" ", "\n", 1))
                measured.append(row["ratio_mean_to_ref"])
                low.append(row["ratio_mean_to_ref"] - lo)
                high.append(hi - row["ratio_mean_to_ref"])
                predicted.append(row["predicted_ratio_mean_to_ref"])
    if figure and figure != "none" and labels:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(labels)), 4.8))
        xs = np.arange(len(labels))
        ax.bar(xs, measured, yerr=[low, high], capsize=5, color="#6d9dc5", label="measured (95% paired bootstrap CI)")
        ax.scatter(xs, predicted, color="#c0392b", marker="D", zorder=3, label="simulator, same drawn costs")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_ylabel("speedup of hsdp-delayed over hsdp\n(mean step time hsdp / hsdp-delayed)")
        ax.set_ylim(max(0.0, min(measured + predicted) - 0.15), None)
        ax.legend(fontsize=8)
        fig.tight_layout()
        Path(figure).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(figure, dpi=120)
        plt.close(fig)
        lines.append(f"\nfigure: {figure}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    opts: SyncBenchOptions = parse_typed_args(SyncBenchOptions, argv, "moetrain bench sync")
    if opts.summarize:
        figure = str(RESULTS_DIR / "sync_summary.png") if opts.figure == "auto" else opts.figure
        print(summarize_runs(opts.summarize, figure))
        return 0
    _validate(opts)
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        raw = run_ranks(opts)
        if raw is not None:
            report(opts, raw)
        return 0
    from moetrain.testing import run_on_ranks

    results = run_on_ranks(run_ranks, opts.replicate * opts.shard, opts, timeout=opts.timeout_s)
    report(opts, results[0])
    return 0
