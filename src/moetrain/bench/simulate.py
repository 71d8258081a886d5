"""Discrete-event model of one optimizer step under the data-parallel sync policies.

Every rank runs `accum` microbatches; each microbatch is a forward and a backward over
`layers` FSDP units. A unit all-gathers its parameters before its forward (and again
before its backward when parameters are resharded after forward); after its backward
it reduce-scatters its gradient over the shard group and, under HSDP when the policy
says so, all-reduces the shard over the replicate group. A collective starts when the
last member of its group is ready and ends for all members at once, so a fast replica
group waits for the slow one exactly where a collective couples them. Durations come
from an alpha-beta model (latency + bytes / bandwidth; intra-node or inter-node link;
ring or tree). The modes are a table of (mesh, when to reduce-scatter, when to
all-reduce); the overlap model says how collectives share time with compute:

- blocking: a collective blocks the issuing rank (FSDP2 on CPU/gloo: plain synchronous calls);
- backward: collectives run on their own streams and overlap the rest of the backward;
  the end of every backward waits for them (FSDP2 on GPU: `finalize_backward` waits on
  the last post-reduce event);
- next_microbatch: like backward, but only the final microbatch waits, so the
  collectives of microbatch i overlap the compute of i+1 (an optimistic bound).

Expert parallelism (`Experts`, `ep`): the last `moe_units` units hold routed experts. With
ep = 1 their expert weights are gathered and reduced with the rest of the unit (FSDP-only);
with ep > 1 a MoE unit gathers and reduces only its 1/ep of the experts, over the
shard / ep ranks that hold them, and each forward and backward of the unit exchanges the
routed token rows with the other ranks of its EP group by all-to-all (alpha-beta, pairwise
exchange, on the critical path: the experts wait for their tokens, the next layer for the
results).

Pipeline parallelism (`--pp`): each replica group is one pipeline running torch's schedule, timed by
`moetrain.bench.simulate_pipeline` with this module's collectives per stage; the table adds its bubble.

Event times are computed in dependency order, vectorised over Monte Carlo samples and
replica groups. Ranks of one replica group share a cost (moetrain.bench.costs), so one
lane per group is exact. This module predicts; it must not run or time anything real.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np

from moetrain.args import check_output_path, parse_typed_args
from moetrain.bench import goodput
from moetrain.bench.costs import (
    CostSpec,
    draw_costs,
    expected_max_of_sum_bimodal,
    expected_sum_of_max_bimodal,
    load_trace,
)
from moetrain.bench.simulate_figure import draw_figure
from moetrain.bench.simulate_pipeline import Action, pipeline_step_times, schedule_order
from moetrain.errors import ConfigError

Mode = Literal["fsdp", "hsdp", "hsdp-delayed", "hsdp-final-only"]
Overlap = Literal["blocking", "backward", "next_microbatch"]
When = Literal["every", "last", "never"]


@dataclass(frozen=True)
class ModeRule:
    """What one mode does: its mesh and when the two gradient collectives run."""

    mesh: Literal["1d", "2d"]
    reduce_scatter: When
    all_reduce: When

    def flags(self, is_last: bool) -> tuple[bool, bool]:
        """(reduce-scatter this microbatch, all-reduce this microbatch)."""
        runs = {"every": True, "last": is_last, "never": False}
        return runs[self.reduce_scatter], runs[self.all_reduce]


MODES: dict[str, ModeRule] = {
    "fsdp": ModeRule("1d", "every", "never"),  # one shard group over the whole world
    "hsdp": ModeRule("2d", "every", "every"),
    "hsdp-delayed": ModeRule("2d", "every", "last"),  # set_requires_all_reduce(is_last)
    "hsdp-final-only": ModeRule("2d", "last", "last"),  # set_requires_gradient_sync(is_last)
}
REFERENCE_MODE = "hsdp-delayed"


@dataclass(frozen=True)
class Link:
    alpha_s: float = 5e-6  # per-message latency, seconds
    bandwidth: float = 150e9  # bytes per second; inf = free

    def validate(self, name: str) -> Link:
        if not self.alpha_s >= 0:
            raise ConfigError(f"{name}.alpha_s = {self.alpha_s!r} is invalid: must be >= 0")
        if not self.bandwidth > 0:
            raise ConfigError(f"{name}.bandwidth = {self.bandwidth!r} is invalid: must be > 0 (bytes/s)")
        return self


@dataclass(frozen=True)
class CommModel:
    """Alpha-beta collective costs; defaults are H100-node-like (NVLink inside, 200 Gb/s per GPU across)."""

    intra: Link = field(default_factory=lambda: Link(5e-6, 150e9))
    inter: Link = field(default_factory=lambda: Link(20e-6, 25e9))
    ranks_per_node: int = 8
    algorithm: Literal["ring", "tree"] = "ring"
    # The token all-to-all's own link (e.g. fitted to measured all-to-alls); None: intra/inter by placement.
    all_to_all_link: Link | None = None

    def validate(self) -> CommModel:
        self.intra.validate("comm.intra")
        self.inter.validate("comm.inter")
        if self.all_to_all_link is not None:
            self.all_to_all_link.validate("comm.all_to_all_link")
        if self.ranks_per_node < 1:
            raise ConfigError(f"comm.ranks_per_node = {self.ranks_per_node!r} is invalid: must be >= 1")
        if self.algorithm not in ("ring", "tree"):
            raise ConfigError(f"comm.algorithm = {self.algorithm!r} is invalid: valid are ('ring', 'tree')")
        return self

    def link(self, ranks: Sequence[int]) -> Link:
        nodes = {rank // self.ranks_per_node for rank in ranks}
        return self.intra if len(nodes) <= 1 else self.inter

    def reduce_scatter(self, nbytes_in: float, n: int, link: Link) -> float:
        """Reduce-scatter of an n-rank group, `nbytes_in` per rank before scattering (all-gather: same cost)."""
        if n <= 1:
            return 0.0
        steps = n - 1 if self.algorithm == "ring" else math.ceil(math.log2(n))
        return steps * link.alpha_s + (n - 1) / n * nbytes_in / link.bandwidth

    def all_to_all(self, nbytes_out: float, n: int, link: Link) -> float:
        """All-to-all of an n-rank group, each rank sending `nbytes_out` spread over the group (1/n to itself).

        Pairwise exchange: n - 1 messages per rank, (n - 1)/n of its bytes on the wire. The same for
        `ring` and `tree` (an all-to-all has no reduction tree).
        """
        if n <= 1:
            return 0.0
        return (n - 1) * link.alpha_s + (n - 1) / n * nbytes_out / link.bandwidth

    def all_reduce(self, nbytes: float, n: int, link: Link) -> float:
        if n <= 1:
            return 0.0
        if self.algorithm == "ring":  # reduce-scatter then all-gather
            return 2 * self.reduce_scatter(nbytes, n, link)
        # tree: reduce up and broadcast down a (pipelined, double binary) tree
        return 2 * math.ceil(math.log2(n)) * link.alpha_s + 2 * nbytes / link.bandwidth


@dataclass(frozen=True)
class Workload:
    """What one microbatch moves and how its compute splits over FSDP units."""

    layers: int = 8  # FSDP units, each with its own all-gather / reduce-scatter / all-reduce
    grad_bytes: float = 2e9  # unsharded gradient bytes of the whole model in the reduce dtype
    param_bytes: float | None = None  # unsharded parameter bytes all-gathered (default: grad_bytes)
    forward_fraction: float = 1 / 3  # share of a microbatch's compute spent in forward
    reshard_after_forward: bool = True  # all-gather again before backward
    overlap: Overlap = "backward"
    # Extra fixed seconds per (rank, collective call): framework bookkeeping around each collective.
    per_call_overhead_s: float = 0.0

    def validate(self) -> Workload:
        if self.layers < 1:
            raise ConfigError(f"workload.layers = {self.layers!r} is invalid: must be >= 1")
        if not self.grad_bytes >= 0:
            raise ConfigError(f"workload.grad_bytes = {self.grad_bytes!r} is invalid: must be >= 0")
        if self.param_bytes is not None and not self.param_bytes >= 0:
            raise ConfigError(f"workload.param_bytes = {self.param_bytes!r} is invalid: must be >= 0")
        if not 0 <= self.forward_fraction <= 1:
            raise ConfigError(f"workload.forward_fraction = {self.forward_fraction!r} is invalid: must be in [0, 1]")
        if self.overlap not in ("blocking", "backward", "next_microbatch"):
            raise ConfigError(f"workload.overlap = {self.overlap!r} is invalid: valid are "
                              "('blocking', 'backward', 'next_microbatch')")
        if not self.per_call_overhead_s >= 0:
            raise ConfigError(f"workload.per_call_overhead_s = {self.per_call_overhead_s!r} is invalid: must be >= 0")
        return self


@dataclass(frozen=True)
class Experts:
    """The routed experts of the workload, to compare FSDP-only (ep = 1) with expert parallelism.

    `param_bytes` of the workload's parameter (and, in the reduce dtype, `grad_bytes`) bytes are
    routed-expert weights, spread evenly over the last `moe_units` units; the rest is spread over every
    unit. `dispatch_bytes`: routed token rows one rank sends per MoE unit and microbatch (tokens x top_k
    x hidden x bytes per element). Under EP each MoE unit makes `forward_all_to_alls` all-to-alls in its
    forward (moetrain: counts, rows, gates, combine) and `backward_all_to_alls` in its backward (the
    gradients of rows, gates and combine); `rows_per_pass` of them carry the rows, the others only latency.
    """

    moe_units: int = 0
    param_bytes: float = 0.0
    grad_bytes: float | None = None  # expert gradient bytes (default: param_bytes)
    dispatch_bytes: float = 0.0
    forward_all_to_alls: int = 4
    backward_all_to_alls: int = 3
    rows_per_pass: int = 2

    def validate(self, workload: Workload) -> Experts:
        if not 0 <= self.moe_units <= workload.layers:
            raise ConfigError(f"experts.moe_units = {self.moe_units!r} is invalid: must be in [0, workload.layers = "
                              f"{workload.layers}]")
        for name in ("param_bytes", "dispatch_bytes"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"experts.{name} = {getattr(self, name)!r} is invalid: must be >= 0")
        if self.grad_bytes is not None and not self.grad_bytes >= 0:
            raise ConfigError(f"experts.grad_bytes = {self.grad_bytes!r} is invalid: must be >= 0")
        whole_param = workload.grad_bytes if workload.param_bytes is None else workload.param_bytes
        if self.param_bytes > whole_param or self.expert_grad_bytes > workload.grad_bytes:
            raise ConfigError(f"experts.param_bytes = {self.param_bytes!r} is invalid: the experts are part of the "
                              f"workload's {whole_param!r} parameter / {workload.grad_bytes!r} gradient bytes")
        if self.moe_units == 0 and (self.param_bytes or self.dispatch_bytes):
            raise ConfigError("experts.moe_units = 0 is invalid with expert bytes: say how many units are MoE")
        for name in ("forward_all_to_alls", "backward_all_to_alls", "rows_per_pass"):
            if getattr(self, name) < 0:
                raise ConfigError(f"experts.{name} = {getattr(self, name)!r} is invalid: must be >= 0")
        return self

    @property
    def expert_grad_bytes(self) -> float:
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes


@dataclass(frozen=True)
class CollectiveTimes:
    """Per-unit durations of the collectives of one mode, and which lanes each one couples.

    `all_gather` .. `all_reduce` are a unit without experts; `moe_*` a MoE unit (its expert weights
    included: in the same call at ep = 1, in a second call on the expert-FSDP group under EP);
    `all_to_all_forward` / `_backward` the token exchanges of one MoE unit's forward / backward.
    """

    all_gather: float
    reduce_scatter: float
    all_reduce: float
    shard_group_spans_groups: bool  # 1-D FSDP: the shard group is the whole world
    moe_all_gather: float = 0.0
    moe_reduce_scatter: float = 0.0
    moe_all_reduce: float = 0.0
    all_to_all_forward: float = 0.0
    all_to_all_backward: float = 0.0


def collective_times(mode: str, replicate: int, shard: int, workload: Workload, comm: CommModel,
                     experts: Experts | None = None, ep: int = 1) -> CollectiveTimes:
    rule = MODES[mode]
    experts = experts or Experts()
    param_bytes = workload.grad_bytes if workload.param_bytes is None else workload.param_bytes
    unit_grad = (workload.grad_bytes - experts.expert_grad_bytes) / workload.layers
    unit_param = (param_bytes - experts.param_bytes) / workload.layers
    moe_units = max(experts.moe_units, 1)
    expert_param, expert_grad = experts.param_bytes / moe_units, experts.expert_grad_bytes / moe_units
    extra = workload.per_call_overhead_s
    # The shard group: the whole world in 1-D FSDP, else replica group 0 (every group is laid out alike).
    shard_group = list(range(replicate * shard)) if rule.mesh == "1d" else list(range(shard))
    n = len(shard_group)
    shard_link = comm.link(shard_group)
    replicate_group = [g * shard for g in range(replicate)]  # shard position 0 of every group
    replicate_link = comm.link(replicate_group)
    if ep > 1 and n % ep:
        raise ConfigError(f"ep = {ep} is invalid: must divide the shard group of {n} ranks ({mode})")

    def gather(nbytes: float, ranks: int, link: Link) -> float:
        return comm.reduce_scatter(nbytes, ranks, link) + extra  # all-gather: the same alpha-beta cost

    def reduce(nbytes: float, ranks: int, link: Link) -> float:
        if rule.mesh == "1d":
            return 0.0
        return comm.all_reduce(nbytes / ranks, replicate, replicate_link) + extra

    times = CollectiveTimes(gather(unit_param, n, shard_link), gather(unit_grad, n, shard_link),
                            reduce(unit_grad, n, shard_link), rule.mesh == "1d")
    if experts.moe_units == 0:
        return times
    if ep == 1:  # experts in the unit's own buffers
        return replace(times, moe_all_gather=gather(unit_param + expert_param, n, shard_link),
                       moe_reduce_scatter=gather(unit_grad + expert_grad, n, shard_link),
                       moe_all_reduce=reduce(unit_grad + expert_grad, n, shard_link))
    # Expert FSDP group: the shard-group ranks holding the same experts (stride ep); EP group: ep consecutive ranks.
    efsdp = n // ep
    efsdp_link = comm.link(shard_group[::ep])
    ep_link = comm.all_to_all_link or comm.link(list(range(ep)))
    rows = comm.all_to_all(experts.dispatch_bytes, ep, ep_link)
    latency = comm.all_to_all(0.0, ep, ep_link)

    def exchanges(calls: int) -> float:
        with_rows = min(experts.rows_per_pass, calls)
        return with_rows * rows + (calls - with_rows) * latency + calls * extra

    return replace(
        times,
        moe_all_gather=times.all_gather + gather(expert_param / ep, efsdp, efsdp_link),
        moe_reduce_scatter=times.reduce_scatter + gather(expert_grad / ep, efsdp, efsdp_link),
        moe_all_reduce=times.all_reduce + reduce(expert_grad / ep, efsdp, efsdp_link),
        all_to_all_forward=exchanges(experts.forward_all_to_alls),
        all_to_all_backward=exchanges(experts.backward_all_to_alls),
    )


def simulate_step_times(compute_s: np.ndarray, replicate: int, shard: int, mode: str, workload: Workload,
                        comm: CommModel, experts: Experts | None = None, ep: int = 1) -> np.ndarray:
    """Step times [samples] for compute seconds [samples, accum, replicate] (one lane per replica group).

    `experts` / `ep`: the routed experts and the expert-parallel degree (default: no experts).
    """
    if mode not in MODES:
        raise ConfigError(f"mode {mode!r} is invalid: valid are {tuple(MODES)}")
    workload.validate()
    comm.validate()
    experts = (experts or Experts()).validate(workload)
    if ep > 1 and experts.moe_units == 0:
        raise ConfigError(f"ep = {ep} is invalid without MoE units: set experts.moe_units")
    if ep < 1 or shard % ep:
        raise ConfigError(f"ep = {ep} is invalid: must divide shard = {shard} (EP groups lie inside a replica group)")
    compute_s = np.asarray(compute_s, dtype=np.float64)
    if compute_s.ndim != 3 or compute_s.shape[2] != replicate:
        raise ConfigError(f"compute shape {compute_s.shape} is invalid: expected [samples, accum, {replicate}]")
    rule = MODES[mode]
    times = collective_times(mode, replicate, shard, workload, comm, experts, ep)
    samples, accum, _ = compute_s.shape
    layers = workload.layers
    first_moe = layers - experts.moe_units  # MoE blocks come after the dense ones
    fwd_share = workload.forward_fraction / layers
    bwd_share = (1 - workload.forward_fraction) / layers

    def couple_gather(ready: np.ndarray) -> np.ndarray:
        # All-gather group: the replica group itself (its lanes are identical), or the whole world in 1-D FSDP.
        return np.broadcast_to(ready.max(axis=1, keepdims=True), ready.shape) if times.shard_group_spans_groups \
            else ready

    couple_reduce_scatter = couple_gather

    def couple_all_reduce(ready: np.ndarray) -> np.ndarray:
        return np.broadcast_to(ready.max(axis=1, keepdims=True), ready.shape)

    zeros = np.zeros((samples, replicate))
    compute_free, gather_free, rs_free, ar_free = zeros.copy(), zeros.copy(), zeros.copy(), zeros.copy()
    blocking = workload.overlap == "blocking"
    for mb in range(accum):
        is_last = mb == accum - 1
        do_rs, do_ar = rule.flags(is_last)
        cost = compute_s[:, mb, :]
        passes = [(layer, fwd_share, False) for layer in range(layers)]
        passes += [(layer, bwd_share, True) for layer in reversed(range(layers))]
        previous_unit_start = compute_free
        for layer, share, is_backward in passes:
            moe = layer >= first_moe
            all_gather = times.moe_all_gather if moe else times.all_gather
            gathers = not is_backward or workload.reshard_after_forward
            if gathers:
                if blocking:
                    compute_free = couple_gather(compute_free) + all_gather
                else:
                    # Prefetched one unit ahead on its own stream: issued when the previous unit's
                    # compute starts; this unit's compute waits for it.
                    start = couple_gather(np.maximum(gather_free, previous_unit_start))
                    gather_free = start + all_gather
                    compute_free = np.maximum(compute_free, gather_free)
            previous_unit_start = compute_free
            # The token all-to-alls sit inside the unit's compute (within one replica group's lane).
            exchange = (times.all_to_all_backward if is_backward else times.all_to_all_forward) if moe else 0.0
            compute_free = compute_free + cost * share + exchange
            if not is_backward:
                continue
            reduce_scatter = times.moe_reduce_scatter if moe else times.reduce_scatter
            all_reduce = times.moe_all_reduce if moe else times.all_reduce
            if blocking:
                if do_rs:
                    compute_free = couple_reduce_scatter(compute_free) + reduce_scatter
                if do_ar:
                    compute_free = couple_all_reduce(compute_free) + all_reduce
            else:
                if do_rs:
                    rs_free = couple_reduce_scatter(np.maximum(rs_free, compute_free)) + reduce_scatter
                if do_ar:
                    ar_free = couple_all_reduce(np.maximum(ar_free, rs_free)) + all_reduce
        if not blocking and (workload.overlap == "backward" or is_last):
            compute_free = np.maximum(compute_free, np.maximum(rs_free, ar_free))
    return compute_free.max(axis=1)


@dataclass
class ModePrediction:
    mode: str
    mean_step_s: float
    median_step_s: float
    p90_step_s: float
    ratio_to_reference: float  # mean step time of this mode / mean of hsdp-delayed (same ep)
    ep: int = 1
    ratio_to_ep1: float = 1.0  # mean step time / mean of the same mode without expert parallelism
    bubble_fraction: float = math.nan  # pipeline: mean share of the ranks' time idle before compute ends


def predict(compute_s: np.ndarray, replicate: int, shard: int, workload: Workload, comm: CommModel,
            modes: Sequence[str] = tuple(MODES), experts: Experts | None = None,
            eps: Sequence[int] = (1,), pipeline: dict[int, list[Action]] | None = None) -> list[ModePrediction]:
    """Each mode's step times; `pipeline`: a schedule's action order (`simulate_pipeline`): each replica group a
    pipeline of those ranks, every rank of it `shard` wide."""
    bubbles: dict[str, float] = {}

    def step(mode: str, ep: int) -> np.ndarray:
        if pipeline is None:
            return simulate_step_times(compute_s, replicate, shard, mode, workload, comm, experts, ep)
        times = pipeline_step_times(compute_s, pipeline, collective_times(mode, replicate, shard, workload, comm),
                                    MODES[mode].flags, workload.layers, workload.forward_fraction)
        bubbles[mode] = float(times.bubble_fraction.mean())
        return times.step_s

    step_times = {(mode, ep): step(mode, ep) for ep in eps for mode in modes}
    predictions = []
    for (mode, ep), t in step_times.items():
        reference = step_times.get((REFERENCE_MODE, ep))
        without_ep = step_times.get((mode, 1))
        predictions.append(ModePrediction(
            mode, float(t.mean()), float(np.median(t)), float(np.percentile(t, 90)),
            float(t.mean()) / float(reference.mean()) if reference is not None else float("nan"), ep,
            float(t.mean()) / float(without_ep.mean()) if without_ep is not None else float("nan"),
            bubbles.get(mode, math.nan)))
    return predictions


# ----------------------------------------------------------------------------- command line


@dataclass
class SimulateOptions:
    """Predict step time of each sync policy for a replicate x shard mesh and accumulation steps."""

    replicate: int = 64  # replica groups (dp_replicate)
    shard: int = 8  # ranks per replica group (dp_shard)
    accum: int = 16  # microbatches per optimizer step
    samples: int = 2000  # Monte Carlo steps (cost draws)
    seed: int = 0
    cost: CostSpec = field(default_factory=lambda: CostSpec("bimodal", 0.2, 4.0, 0.5, 0.5))  # seconds
    trace: str | None = None  # JSON with "costs_s": [steps][accum][replicate] seconds (e.g. a `bench sync` JSON)
    workload: Workload = field(default_factory=Workload)
    comm: CommModel = field(default_factory=CommModel)
    modes: tuple[str, ...] = tuple(MODES)
    experts: Experts = field(default_factory=Experts)  # routed experts (part of the workload's bytes)
    ep: tuple[int, ...] = (1,)  # expert-parallel degrees to compare (1 = FSDP-only); each divides shard
    json: str | None = None
    figure: str | None = None  # PNG: speedup of hsdp-delayed over hsdp vs replica groups and vs cost CV
    cvs: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5)  # lognormal CVs of the figure's CV panel
    group_counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)  # replica-group counts of the figure
    pp: int = 1  # > 1: each replica group is a pipeline of pp ranks running pp_schedule over the accum microbatches
    pp_schedule: str = "1F1B"  # 1F1B, Interleaved1F1B or ZBVZeroBubble (torch's action order)
    pp_stages_per_rank: int = 1


def _validate(opts: SimulateOptions) -> None:
    lowest = {"replicate": 1, "shard": 1, "accum": 1, "samples": 1, "pp": 1, "pp_stages_per_rank": 1, "seed": 0,
              "cvs": 0, "group_counts": 1}
    for name, low in lowest.items():  # seed: numpy's generators take seeds >= 0; cvs, group_counts: each item
        if np.min(getattr(opts, name), initial=low) < low:
            raise ConfigError(f"{name} = {getattr(opts, name)!r} is invalid: must be >= {low}")
    for name in [name for name in ("json", "figure") if getattr(opts, name)]:
        check_output_path(getattr(opts, name), f"--{name}")
    draws = opts.samples * opts.accum * opts.replicate
    if draws > 1 << 28 or opts.shard > 1 << 24:  # one float64 array of the draws, per-shard arrays beside it
        raise ConfigError(f"samples x accum x replicate = {draws} (shard = {opts.shard}) is too large to simulate "
                          "in memory: at most 2**28 draws and 2**24 shards")
    unknown = [m for m in opts.modes if m not in MODES]
    if unknown:
        raise ConfigError(f"modes {unknown} are invalid: valid are {tuple(MODES)}")
    opts.cost.validate()
    opts.workload.validate()
    opts.comm.validate()
    opts.experts.validate(opts.workload)
    if opts.pp > 1 and opts.ep != (1,):
        raise ConfigError(f"ep = {list(opts.ep)} is invalid with pp = {opts.pp}: the pipeline model has no experts")
    for ep in opts.ep:
        if ep < 1 or opts.shard % ep:
            raise ConfigError(f"ep = {ep} is invalid: must be a positive divisor of shard = {opts.shard}")
        if ep > 1 and opts.experts.moe_units == 0:
            raise ConfigError(f"ep = {ep} needs MoE units: set --experts.moe-units and the expert bytes")


def format_table(predictions: Sequence[ModePrediction]) -> str:
    with_ep = any(p.ep != 1 for p in predictions)
    with_pp = any(math.isfinite(p.bubble_fraction) for p in predictions)
    lines = [f"{'mode':<16} {'ep':>3} {'mean s':>9} {'median s':>9} {'p90 s':>9} {'/ hsdp-delayed':>15}"
             + (f" {'/ ep=1':>8}" if with_ep else "") + (f" {'bubble':>7}" if with_pp else "")]

    def ratio(value: float, width: int) -> str:
        return f"{value:>{width}.3f}" if math.isfinite(value) else f"{'-':>{width}}"  # reference not simulated

    lines += [f"{p.mode:<16} {p.ep:>3} {p.mean_step_s:>9.4f} {p.median_step_s:>9.4f} {p.p90_step_s:>9.4f} "
              f"{ratio(p.ratio_to_reference, 15)}" + (f" {ratio(p.ratio_to_ep1, 8)}" if with_ep else "")
              + (f" {p.bubble_fraction:>7.3f}" if with_pp else "") for p in predictions]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["goodput"]:  # failures over days, not one step: the options of moetrain.bench.goodput
        return goodput.main(argv[1:])
    opts: SimulateOptions = parse_typed_args(SimulateOptions, argv, "moetrain simulate")
    _validate(opts)
    if opts.trace:
        compute = load_trace(opts.trace, opts.replicate)
        source = f"trace {opts.trace} ({compute.shape[0]} steps)"
        if compute.shape[1] != opts.accum:
            raise ConfigError(f"accum = {opts.accum} does not match the trace's {compute.shape[1]} microbatches")
    else:
        compute = draw_costs(opts.cost, opts.seed, opts.samples, opts.accum, opts.replicate)
        source = f"{opts.cost} seed {opts.seed}, {opts.samples} draws"
    order = schedule_order(opts.pp_schedule, opts.pp, opts.pp_stages_per_rank, opts.accum) if opts.pp > 1 else None
    predictions = predict(compute, opts.replicate, opts.shard, opts.workload, opts.comm, opts.modes, opts.experts,
                          opts.ep, order)
    pipeline = f", pipelines of pp {opts.pp} ({opts.pp_schedule})" if order else ""
    overlap = "blocking (pipeline stages)" if order else opts.workload.overlap
    print(f"moetrain simulate: {opts.replicate} replica groups x {opts.shard} shards{pipeline}, accum {opts.accum}, "
          f"overlap={overlap}, {opts.comm.algorithm}; costs: {source}")
    print(format_table(predictions))
    result: dict = {"options": asdict(opts), "modes": [asdict(p) for p in predictions]}
    if not opts.trace and opts.cost.distribution == "bimodal" and order is None:
        bounds = {"sum_of_max_s": expected_sum_of_max_bimodal(opts.cost, opts.accum, opts.replicate),
                  "max_of_sum_s": expected_max_of_sum_bimodal(opts.cost, opts.accum, opts.replicate)}
        print(f"zero-comm limits (exact): E[sum max] = {bounds['sum_of_max_s']:.4f} s (hsdp), "
              f"E[max sum] = {bounds['max_of_sum_s']:.4f} s (hsdp-delayed), "
              f"ratio {bounds['sum_of_max_s'] / bounds['max_of_sum_s']:.3f}")
        result["zero_comm_limits"] = bounds
    if opts.figure and order is None:  # the figure's sweeps are of the pipeline-free model
        result["figure"] = {"path": opts.figure, **draw_figure(opts, opts.figure, simulate_step_times)}
        print(f"figure: {opts.figure}")
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"json: {opts.json}")
    return 0
