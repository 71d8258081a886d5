"""Discrete-event model of one pipeline-parallel step: the schedule's bubble and the gradient sync together.

The action order is torch's own. For the multi-stage schedules (Interleaved1F1B, ZBVZeroBubble) it is
the schedule object's `pipeline_order` (what `_PipelineScheduleRuntime` executes, rank by rank), built
from stand-in stages so no process group is needed. For `Schedule1F1B` it is the loop its
`_step_microbatches` runs (min(m, pp - s) warm-up forwards, then backward/forward pairs, then the
remaining backwards): torch 2.13's `Schedule1F1B.pipeline_order` is only drawn for display and names
the wrong microbatches on the last rank, so it is not used.

Each pipeline rank runs its actions in that order; an action starts when the rank is free and its
inputs exist: a forward F(s, i) needs F(s - 1, i), a backward B or input-backward I(s, i) needs F(s, i)
and the backward of s + 1 for microbatch i, a weight-backward W(s, i) needs I(s, i); crossing ranks
adds `p2p_s`. Durations are per (sample, lane, stage, microbatch): a lane is one pipeline (one replica
group of the data-parallel mesh), so lanes differ only where their microbatch costs do.

Gradient sync follows `simulate.MODES` (the same table `bench sync` runs): after each stage's backward
of a microbatch the mode's flags say whether the stage reduce-scatters over its shard group and
all-reduces over the replicate group; a collective blocks the rank (gloo on CPU) and couples the lanes
it spans (the all-reduce every lane; the reduce-scatter every lane only for 1-D FSDP). Under PP a stage
keeps its weights gathered through the step, so it all-gathers once, before its first forward.

The bubble fraction is 1 - (the ranks' compute seconds) / (pp x the time the last compute ends). This
module predicts; it must not run or time anything real (torch is imported only for the orders).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
from torch import nn
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

from moetrain.errors import ConfigError

PIPELINE_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
COMPUTE_KINDS = ("F", "B", "I", "W")  # forward, full backward, input backward, weight backward


class Action(NamedTuple):
    kind: str  # one of COMPUTE_KINDS
    stage: int
    microbatch: int


def _one_f_one_b(pp: int, n_microbatches: int) -> dict[int, list[Action]]:
    """The order `Schedule1F1B._step_microbatches` runs on each rank (one stage per rank)."""
    order = {}
    for stage in range(pp):
        warmup = min(n_microbatches, pp - stage)
        actions = [Action("F", stage, i) for i in range(warmup)]
        forward = warmup
        for backward in range(n_microbatches):
            actions.append(Action("B", stage, backward))
            if forward < n_microbatches:
                actions.append(Action("F", stage, forward))
                forward += 1
        order[stage] = actions
    return order


def schedule_order(schedule: str, pp: int, stages_per_rank: int, n_microbatches: int) -> dict[int, list[Action]]:
    """pipeline rank -> its compute actions in torch's order (communication and REDUCE_GRAD left out)."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"pp_schedule = {schedule!r} is invalid: valid are {PIPELINE_SCHEDULES}")
    if pp < 2 or n_microbatches < 1 or stages_per_rank < 1:
        raise ConfigError(f"pp = {pp}, microbatches = {n_microbatches}, stages per rank = {stages_per_rank} are "
                          "invalid: need pp >= 2 and positive counts")
    if schedule == "1F1B":
        if stages_per_rank != 1 or n_microbatches < pp:
            raise ConfigError(f"1F1B needs one stage per rank and at least pp = {pp} microbatches "
                              f"(got {stages_per_rank}, {n_microbatches})")
        return _one_f_one_b(pp, n_microbatches)
    n_stages = pp * stages_per_rank
    if schedule == "ZBVZeroBubble":
        if stages_per_rank != 2 or n_microbatches < 2 * pp:
            raise ConfigError(f"ZBVZeroBubble needs 2 stages per rank and at least 2 pp = {2 * pp} microbatches "
                              f"(got {stages_per_rank}, {n_microbatches})")
        stage_ids, cls = [0, n_stages - 1], ScheduleZBVZeroBubble
    else:
        if stages_per_rank < 2 or n_microbatches % pp:
            raise ConfigError(f"Interleaved1F1B needs 2+ stages per rank and a multiple of pp = {pp} microbatches "
                              f"(got {stages_per_rank}, {n_microbatches})")
        stage_ids, cls = [k * pp for k in range(stages_per_rank)], ScheduleInterleaved1F1B
    # Rank 0's stand-in stages: the schedule computes every rank's order from their counts alone.
    stubs = [SimpleNamespace(stage_index=s, num_stages=n_stages, group_size=pp, group_rank=0, submod=nn.Identity(),
                             is_first=s == 0, is_last=s == n_stages - 1) for s in stage_ids]
    torch_order = cls(stubs, n_microbatches).pipeline_order
    return {rank: [Action(a.computation_type.value, a.stage_index, a.microbatch_index) for a in actions
                   if a is not None and a.computation_type.value in COMPUTE_KINDS]
            for rank, actions in torch_order.items()}


@dataclass(frozen=True)
class StageSync:
    """A mode's gradient collectives per stage, seconds (`simulate.collective_times` summed over a stage's units)."""

    flags: Callable[[bool], tuple[bool, bool]]  # is_last -> (reduce-scatter, all-reduce), `simulate.ModeRule.flags`
    all_gather_s: tuple[float, ...]
    reduce_scatter_s: tuple[float, ...]
    all_reduce_s: tuple[float, ...]
    shard_group_spans_lanes: bool = False  # 1-D FSDP: the shard group holds every lane
    # Each stage all-gathers before its first forward; False: its weights are gathered before the step
    # (torch's multi-stage runtime issues them as UNSHARD actions up front), outside this model.
    gathers_at_first_forward: bool = True


@dataclass
class PipelineTimes:
    step_s: np.ndarray  # [samples]: the last rank's end, syncs included
    compute_end_s: np.ndarray  # [samples]: when the last compute action ends
    busy_s: np.ndarray  # [samples, lanes, pp]: each rank's compute seconds
    bubble_fraction: np.ndarray  # [samples]: 1 - busy / (pp x compute end), mean over lanes
    all_reduces: dict[int, int] = field(default_factory=dict)  # stage -> replicate all-reduces per step
    reduce_scatters: dict[int, int] = field(default_factory=dict)
    finish_s: dict[Action, np.ndarray] = field(default_factory=dict)  # each compute action's end [samples, lanes]


def _dependencies(action: Action, n_stages: int, backward_kind: dict[tuple[int, int], str]) -> list[Action]:
    """What `action` waits for; `backward_kind[(stage, mb)]`: "B" or "I", whichever sends that input gradient."""
    kind, stage, mb = action
    if kind == "F":
        return [Action("F", stage - 1, mb)] if stage else []
    if kind == "W":
        return [Action("I", stage, mb)]
    deps = [Action("F", stage, mb)]
    if stage < n_stages - 1:
        deps.append(Action(backward_kind[(stage + 1, mb)], stage + 1, mb))
    return deps


def action_dependencies(order: dict[int, list[Action]]) -> dict[Action, list[Action]]:
    """Every action of `order` and the actions it waits for (the simulator's rules)."""
    backward_kind = {(a.stage, a.microbatch): a.kind for actions in order.values() for a in actions
                     if a.kind in ("B", "I")}
    n_stages = len({a.stage for actions in order.values() for a in actions})
    return {a: _dependencies(a, n_stages, backward_kind) for actions in order.values() for a in actions}


def simulate_pipeline(order: dict[int, list[Action]], costs: dict[str, np.ndarray], p2p_s: float = 0.0,
                      sync: StageSync | None = None, overhead_s: float = 0.0) -> PipelineTimes:
    """Times of one step for each sample; `costs[kind]`: seconds [samples, lanes, stages, microbatches].

    `overhead_s`: the schedule's own seconds before each action, once the rank is free and its inputs are
    there (posting and completing sends and receives, a process waking up); not compute, so it counts
    towards the bubble.
    """
    rank_of = {a.stage: rank for rank, actions in order.items() for a in actions}
    n_stages, pp = len(rank_of), len(order)
    backward_kind = {(a.stage, a.microbatch): a.kind for actions in order.values() for a in actions
                     if a.kind in ("B", "I")}
    n_microbatches = 1 + max(a.microbatch for actions in order.values() for a in actions)
    needed = tuple(k for k in COMPUTE_KINDS if any(a.kind == k for actions in order.values() for a in actions))
    missing = [k for k in needed if k not in costs]
    if missing:
        raise ConfigError(f"pipeline costs lack {missing}: this order needs {needed}")
    shape = costs["F"].shape[:2]
    for kind in needed:
        if costs[kind].shape != (*shape, n_stages, n_microbatches):
            raise ConfigError(f"pipeline costs[{kind!r}] has shape {costs[kind].shape}: expected "
                              f"{(*shape, n_stages, n_microbatches)}")

    def couple(ready: np.ndarray) -> np.ndarray:  # a collective over every lane starts with the last one
        return np.broadcast_to(ready.max(axis=1, keepdims=True), ready.shape)

    free = {rank: np.zeros(shape) for rank in order}
    busy = {rank: np.zeros(shape) for rank in order}
    compute_end = np.zeros(shape)
    finish: dict[Action, np.ndarray] = {}
    backwards: dict[int, int] = {}
    all_reduces = dict.fromkeys(range(n_stages), 0)
    reduce_scatters = dict.fromkeys(range(n_stages), 0)
    position = dict.fromkeys(order, 0)
    remaining = sum(len(actions) for actions in order.values())
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                deps = _dependencies(action, n_stages, backward_kind)
                if any(dep not in finish for dep in deps):
                    break
                start = free[rank]
                if sync is not None and sync.gathers_at_first_forward and action.kind == "F" and action.microbatch == 0:
                    gather = couple(start) if sync.shard_group_spans_lanes else start
                    start = gather + sync.all_gather_s[action.stage]
                for dep in deps:
                    start = np.maximum(start, finish[dep] + (p2p_s if rank_of[dep.stage] != rank else 0.0))
                start = start + overhead_s
                seconds = costs[action.kind][:, :, action.stage, action.microbatch]
                finish[action] = free[rank] = start + seconds
                busy[rank] = busy[rank] + seconds
                compute_end = np.maximum(compute_end, free[rank])
                if sync is not None and action.kind in ("B", "W"):  # a stage's gradient of one microbatch is done
                    backwards[action.stage] = backwards.get(action.stage, 0) + 1
                    do_rs, do_ar = sync.flags(backwards[action.stage] == n_microbatches)
                    if do_rs:
                        ready = couple(free[rank]) if sync.shard_group_spans_lanes else free[rank]
                        free[rank] = ready + sync.reduce_scatter_s[action.stage]
                        reduce_scatters[action.stage] += 1
                    if do_ar:
                        free[rank] = couple(free[rank]) + sync.all_reduce_s[action.stage]
                        all_reduces[action.stage] += 1
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline order deadlocks: ranks wait at {[order[r][position[r]] for r in order]}")
    step = np.max([free[rank] for rank in order], axis=0).max(axis=1)
    busy_s = np.stack([busy[rank] for rank in order], axis=-1)
    bubble = 1 - busy_s.sum(axis=-1) / (pp * np.maximum(compute_end, 1e-300))
    return PipelineTimes(step, compute_end.max(axis=1), busy_s, bubble.mean(axis=1), all_reduces, reduce_scatters,
                         finish)


def stage_costs_from_microbatches(compute_s: np.ndarray, n_stages: int, forward_fraction: float = 1 / 3,
                                  weight_fraction: float = 0.5) -> dict[str, np.ndarray]:
    """Per-stage action seconds from whole-model microbatch seconds [samples, accum, lanes].

    Every stage gets 1/n_stages of a microbatch's compute (the bench's layers split evenly), `forward_fraction`
    of it in the forward; a split backward gives `weight_fraction` of the backward to W.
    """
    per_stage = np.asarray(compute_s, dtype=np.float64).transpose(0, 2, 1)[:, :, None, :] / n_stages
    per_stage = np.broadcast_to(per_stage, (*per_stage.shape[:2], n_stages, per_stage.shape[-1]))
    backward = per_stage * (1 - forward_fraction)
    return {"F": per_stage * forward_fraction, "B": backward, "I": backward * (1 - weight_fraction),
            "W": backward * weight_fraction}


def one_f_one_b_bubble(pp: int, n_microbatches: int) -> float:
    """The closed form for 1F1B with equal stage costs and free communication: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (n_microbatches + pp - 1)


def pipeline_step_times(compute_s: np.ndarray, order: dict[int, list[Action]], times, flags: Callable[[bool], tuple],
                        layers: int, forward_fraction: float = 1 / 3, p2p_s: float = 0.0) -> PipelineTimes:
    """A pipeline step per sample for whole-model microbatch seconds [samples, accum, replica groups].

    `times`: one FSDP unit's collective seconds (`simulate.collective_times`), `flags`: the mode's
    (`simulate.ModeRule.flags`); each stage holds layers / stages units.
    """
    n_stages = len({a.stage for actions in order.values() for a in actions})
    if layers % n_stages:
        raise ConfigError(f"workload.layers = {layers} is invalid: must split evenly over {n_stages} pipeline stages")
    units = layers // n_stages
    sync = StageSync(flags, (units * times.all_gather,) * n_stages, (units * times.reduce_scatter,) * n_stages,
                     (units * times.all_reduce,) * n_stages, times.shard_group_spans_groups)
    return simulate_pipeline(order, stage_costs_from_microbatches(compute_s, n_stages, forward_fraction), p2p_s, sync)
