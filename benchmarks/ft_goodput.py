"""Goodput with and without fault-tolerant HSDP at 1,000-10,000 GPUs: an event simulation of node failures.

A run of `--days` on N GPUs (8 per node) whose nodes fail independently (exponential, mean time
between failures `--node-mtbf-h` per node). Goodput = the GPU-time that trained / the GPU-time paid.

- Checkpoint-restart (no fault tolerance): a failure stops every rank; the job restarts
  (`--restart-s`: scheduling, process start, model build, checkpoint read) and redoes the work since
  the last checkpoint (every `--checkpoint-every-s`, each save blocking `--checkpoint-s`).
- torchft (replica groups of `--group-nodes` nodes): a failure stalls every group for `--stall-s`
  (measured: the lighthouse heartbeat timeout plus the redone step), and the lost group is out for
  `--restart-s` plus `--rejoin-s` (measured: quorum, copy from a peer, one step) while the others
  train; every step pays `--ft-overhead` (measured step-time ratio against plain HSDP), and the
  checkpoints are still written as above.

The defaults of --stall-s, --rejoin-s and --ft-overhead are this repository's measurements on a
2-core CPU with a tiny model (benchmarks/results/ft_kill.json, ft_overhead.json), with the stall
scaled to torchft's default 5 s heartbeat timeout; --node-mtbf-h and --restart-s are assumptions to
vary, not measurements. This script predicts; it runs nothing real.
    PYTHONPATH=src .venv/bin/python benchmarks/ft_goodput.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def checkpoint_restart(failures: np.ndarray, horizon_s: float, a: argparse.Namespace) -> float:
    """Useful seconds over `horizon_s` of wall time when each failure restarts everything.

    Between a restart and the next failure the job trains in periods of checkpoint_every_s plus a
    blocking save; what it trained after the last save is lost at the failure (kept at the end). A
    failure during a restart starts the restart over.
    """
    useful, t = 0.0, 0.0
    period = a.checkpoint_every_s + a.checkpoint_s
    for event in np.append(failures, horizon_s):
        running = max(event - t, 0.0)
        saved = running // period
        useful += saved * a.checkpoint_every_s
        if event == horizon_s:
            useful += min(running - saved * period, a.checkpoint_every_s)
        t = max(t, event + a.restart_s)
    return useful


def torchft(failures: np.ndarray, horizon_s: float, groups: int, a: argparse.Namespace, overhead: float) -> float:
    """Useful GPU-seconds / GPUs: every failure stalls all groups, the lost group is out for a while, and
    the checkpoints are still written (one group writes; the others wait for it at the next all-reduce)."""
    lost = len(failures) * a.stall_s + len(failures) * (a.restart_s + a.rejoin_s) / groups
    saving = a.checkpoint_every_s / (a.checkpoint_every_s + a.checkpoint_s)
    return max(horizon_s - lost, 0.0) * saving / overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1000, 2000, 5000, 10000])
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--node-mtbf-h", type=float, default=5000.0)
    parser.add_argument("--restart-s", type=float, default=600.0)
    parser.add_argument("--checkpoint-every-s", type=float, default=1800.0)
    parser.add_argument("--checkpoint-s", type=float, default=30.0)
    parser.add_argument("--group-nodes", type=int, default=4)
    parser.add_argument("--stall-s", type=float, default=5.4)  # measured 1.7-1.9 s at a 1.5 s heartbeat timeout
    parser.add_argument("--rejoin-s", type=float, default=2.6)  # measured 1.1-2.6 s
    parser.add_argument("--ft-overhead", type=float, default=1.15)  # measured 1.03-1.15
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--out", default="ft_goodput.json", help="file name under benchmarks/results")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    horizon = args.days * 86400
    rows = []
    for gpus in args.gpus:
        nodes = gpus // 8
        rate = nodes / (args.node_mtbf_h * 3600)  # failures per second, the whole cluster
        plain, ft, ft_failures_only, counts = [], [], [], []
        for _ in range(args.samples):
            failures = np.sort(rng.uniform(0, horizon, rng.poisson(rate * horizon)))
            counts.append(len(failures))
            plain.append(checkpoint_restart(failures, horizon, args) / horizon)
            ft.append(torchft(failures, horizon, nodes // args.group_nodes, args, args.ft_overhead) / horizon)
            ft_failures_only.append(torchft(failures, horizon, nodes // args.group_nodes, args, 1.0) / horizon)
        rows.append({"gpus": gpus, "failures_per_day": float(np.mean(counts)) / args.days,
                     "goodput_checkpoint_restart": float(np.mean(plain)), "goodput_torchft": float(np.mean(ft)),
                     "goodput_torchft_without_step_overhead": float(np.mean(ft_failures_only))})
        print(f"{gpus:>6} GPUs  {rows[-1]['failures_per_day']:6.1f} failures/day  checkpoint-restart "
              f"{rows[-1]['goodput_checkpoint_restart']:.4f}  torchft {rows[-1]['goodput_torchft']:.4f}  "
              f"torchft without its step overhead {rows[-1]['goodput_torchft_without_step_overhead']:.4f}")
    (RESULTS / args.out).write_text(json.dumps({"options": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
