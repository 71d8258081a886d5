"""Goodput of a long run on a cluster whose nodes fail: checkpoint-restart against fault-tolerant HSDP (torchft).

`moetrain simulate goodput`: N GPUs in nodes of `gpus_per_node`; each node fails independently
(Poisson, mean time between failures `node_mtbf_h`), so the cluster fails at rate
Λ = nodes / MTBF. Goodput = GPU-time that trained / GPU-time paid, over `days` of wall time,
mean of `samples` drawn failure histories, and its long-run closed form beside it.

- Checkpoint-restart (no fault tolerance): a failure stops every rank; the job restarts
  (`restart_s`: scheduling, process start, model build, checkpoint read; a failure during it
  starts it over) and redoes the work since its last checkpoint (a save every
  `checkpoint_every_s` of training, each blocking `checkpoint_s`). Renewal-reward over the cycle
  "restart, then train until the next failure": with P = checkpoint_every_s + checkpoint_s and
  q = exp(-Λ P), goodput = checkpoint_every_s · q / (1 - q) · Λ · exp(-Λ restart_s).
- torchft (replica groups of `group_nodes` nodes, G = nodes / group_nodes of them): a failure in a
  live group takes that group out for D = restart_s + rejoin_s (restart from scratch when one of
  its nodes fails meanwhile), and stalls every other live group for `stall_s` (the lighthouse's
  heartbeat timeout and the redone step); the checkpoints are still written, and every step
  costs `ft_overhead` times plain HSDP's. Each group is up a fraction u = exp(-Λ D / G) of the
  time (renewal-reward again); failures reach live groups at rate Λ u and each stalls the
  (G - 1) u G-ths of the GPUs expected live elsewhere, so goodput =
  (u - Λ stall_s u² (G - 1) / G) · checkpoint_every_s / P / ft_overhead. Not modelled: every group
  lost at once (the run then resumes from a checkpoint as above) and a lost lighthouse.

The defaults of `stall_s`, `rejoin_s` and `ft_overhead` are measurements (docs/results.md, "Fault
tolerance"); `node_mtbf_h` and `restart_s` are assumptions to vary. This module predicts; it must
not run or time anything real.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from moetrain.args import parse_typed_args
from moetrain.errors import ConfigError


@dataclass
class GoodputOptions:
    """Goodput with and without fault-tolerant HSDP (torchft) on a cluster whose nodes fail."""

    gpus: tuple[int, ...] = (1000, 2000, 5000, 10000)
    gpus_per_node: int = 8
    node_mtbf_h: tuple[float, ...] = (5000.0, 1000.0)  # assumed mean time between failures of one node
    days: float = 7.0  # wall time of one drawn history
    restart_s: float = 600.0  # assumed: a job's (or a group's) restart after a failure
    checkpoint_every_s: float = 1800.0  # training time between checkpoints
    checkpoint_s: float = 30.0  # one blocking save
    group_nodes: int = 4  # nodes per replica group under torchft
    stall_s: float = 5.4  # measured 1.7-1.9 s at a 1.5 s heartbeat timeout, scaled to torchft's default 5 s
    rejoin_s: float = 2.6  # measured 1.1-2.6 s: quorum, the copy from a live peer, one step
    ft_overhead: float = 1.0  # step time under torchft / plain HSDP's (measured on CPU: docs/results.md)
    samples: int = 200
    seed: int = 0
    json: str | None = None

    def validate(self) -> None:
        for name in ("gpus_per_node", "group_nodes", "samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} = {getattr(self, name)} is invalid: must be >= 1")
        for name in ("days", "checkpoint_every_s", "ft_overhead"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} = {getattr(self, name)} is invalid: must be > 0")
        for name in ("restart_s", "checkpoint_s", "stall_s", "rejoin_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"--{name.replace('_', '-')} = {getattr(self, name)} is invalid: must be >= 0")
        if not self.node_mtbf_h or min(self.node_mtbf_h) <= 0:
            raise ConfigError(f"--node-mtbf-h = {self.node_mtbf_h} is invalid: hours > 0")
        for gpus in self.gpus:
            if gpus < self.gpus_per_node * self.group_nodes:
                raise ConfigError(f"--gpus {gpus} is invalid: at least one replica group of "
                                  f"{self.group_nodes} x {self.gpus_per_node} GPUs")


@dataclass(frozen=True)
class Cluster:
    nodes: int
    failure_rate: float  # Λ, failures per second of the whole cluster
    groups: int  # replica groups under torchft


def cluster(opts: GoodputOptions, gpus: int, node_mtbf_h: float) -> Cluster:
    """`gpus` rounded down to whole replica groups (the same nodes for both ways of running)."""
    groups = gpus // (opts.gpus_per_node * opts.group_nodes)
    nodes = groups * opts.group_nodes
    return Cluster(nodes, nodes / (node_mtbf_h * 3600.0), groups)


def closed_form_checkpoint_restart(c: Cluster, opts: GoodputOptions) -> float:
    """Long-run goodput of checkpoint-restart (renewal-reward; the module docstring)."""
    rate, period = c.failure_rate, opts.checkpoint_every_s + opts.checkpoint_s
    if rate == 0:
        return opts.checkpoint_every_s / period
    q = math.exp(-rate * period)
    return opts.checkpoint_every_s * q / -math.expm1(-rate * period) * rate * math.exp(-rate * opts.restart_s)


def closed_form_torchft(c: Cluster, opts: GoodputOptions, overhead: float) -> float:
    """Long-run goodput under torchft (renewal-reward per group; the module docstring)."""
    up = math.exp(-c.failure_rate * (opts.restart_s + opts.rejoin_s) / c.groups)
    stalled = c.failure_rate * opts.stall_s * up * up * (c.groups - 1) / c.groups
    saving = opts.checkpoint_every_s / (opts.checkpoint_every_s + opts.checkpoint_s)
    return (up - stalled) * saving / overhead


def simulate_checkpoint_restart(failures: np.ndarray, horizon_s: float, opts: GoodputOptions) -> float:
    """Trained seconds / horizon when each failure restarts everything from the last checkpoint.

    Between a restart and the next failure the job trains in periods of checkpoint_every_s plus a
    blocking save; what it trained since the last save is lost at the failure (kept at the horizon).
    A failure during a restart starts the restart over.
    """
    useful, t = 0.0, 0.0
    period = opts.checkpoint_every_s + opts.checkpoint_s
    for event in np.append(failures, horizon_s):
        running = max(event - t, 0.0)
        saved = running // period
        useful += saved * opts.checkpoint_every_s
        if event == horizon_s:
            useful += min(running - saved * period, opts.checkpoint_every_s)
        t = max(t, event + opts.restart_s)
    return useful / horizon_s


def simulate_torchft(failures: np.ndarray, failed_groups: np.ndarray, horizon_s: float, groups: int,
                     opts: GoodputOptions, overhead: float) -> float:
    """Trained GPU-seconds / (GPUs x horizon) under torchft, one failure at a time.

    A failure takes its group out until failure + restart_s + rejoin_s (later if another of its nodes
    fails meanwhile: the restart starts over); a failure in a live group stalls each other live group
    for stall_s. The saves and the step overhead scale what is left.
    """
    outage = opts.restart_s + opts.rejoin_s
    down_until = np.zeros(groups)
    down_s = 0.0  # group-seconds out
    stall_s = 0.0  # group-seconds stalled
    for at, group in zip(failures, failed_groups, strict=True):
        live = down_until <= at
        if live[group]:
            stall_s += opts.stall_s * (int(live.sum()) - 1)
        start = max(at, down_until[group])
        down_s += max(min(at + outage, horizon_s) - min(start, horizon_s), 0.0)
        down_until[group] = at + outage
    saving = opts.checkpoint_every_s / (opts.checkpoint_every_s + opts.checkpoint_s)
    return (1.0 - (down_s + stall_s) / (groups * horizon_s)) * saving / overhead


def draw_failures(rng: np.random.Generator, c: Cluster, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(sorted failure times, the replica group each failed node belongs to) of one history."""
    count = rng.poisson(c.failure_rate * horizon_s)
    group_nodes = c.nodes // c.groups
    return np.sort(rng.uniform(0, horizon_s, count)), rng.integers(0, c.nodes, count) // group_nodes


def goodput_rows(opts: GoodputOptions) -> list[dict]:
    """One row per (node MTBF, GPUs): failures per day, simulated means and closed forms."""
    rng = np.random.default_rng(opts.seed)
    horizon = opts.days * 86400
    rows = []
    for mtbf in opts.node_mtbf_h:
        for gpus in opts.gpus:
            c = cluster(opts, gpus, mtbf)
            plain, ft, ft_failures_only = [], [], []
            for _ in range(opts.samples):
                times, groups = draw_failures(rng, c, horizon)
                plain.append(simulate_checkpoint_restart(times, horizon, opts))
                ft.append(simulate_torchft(times, groups, horizon, c.groups, opts, opts.ft_overhead))
                ft_failures_only.append(simulate_torchft(times, groups, horizon, c.groups, opts, 1.0))
            rows.append({"gpus": gpus, "gpus_modelled": c.nodes * opts.gpus_per_node, "node_mtbf_h": mtbf,
                         "replica_groups": c.groups,
                         "failures_per_day": c.failure_rate * 86400,
                         "checkpoint_restart": float(np.mean(plain)),
                         "checkpoint_restart_p5": float(np.percentile(plain, 5)),
                         "checkpoint_restart_closed_form": closed_form_checkpoint_restart(c, opts),
                         "torchft": float(np.mean(ft)),
                         "torchft_closed_form": closed_form_torchft(c, opts, opts.ft_overhead),
                         "torchft_without_step_overhead": float(np.mean(ft_failures_only))})
    return rows


def format_table(rows: list[dict], opts: GoodputOptions) -> str:
    lines = ["| GPUs | node MTBF | failures / day | checkpoint-restart (5th pct) [closed form] | "
             f"torchft, {opts.ft_overhead:g} step overhead [closed form] | torchft, failures only |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gpus']:,} | {r['node_mtbf_h']:,.0f} h | {r['failures_per_day']:.1f} | "
                     f"{r['checkpoint_restart']:.3f} ({r['checkpoint_restart_p5']:.3f}) "
                     f"[{r['checkpoint_restart_closed_form']:.3f}] | {r['torchft']:.4f} "
                     f"[{r['torchft_closed_form']:.4f}] | {r['torchft_without_step_overhead']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    opts: GoodputOptions = parse_typed_args(GoodputOptions, argv, "moetrain simulate goodput")
    opts.validate()
    rows = goodput_rows(opts)
    print(f"moetrain simulate goodput: {opts.days:g}-day histories x {opts.samples}, {opts.gpus_per_node} GPUs per "
          f"node, torchft groups of {opts.group_nodes} nodes, restart {opts.restart_s:g} s, stall "
          f"{opts.stall_s:g} s, rejoin {opts.rejoin_s:g} s, checkpoint {opts.checkpoint_s:g} s every "
          f"{opts.checkpoint_every_s:g} s")
    print(format_table(rows, opts))
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps({"options": asdict(opts), "rows": rows}, indent=2) + "\n")
        print(f"json: {opts.json}")
    return 0
