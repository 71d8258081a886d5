"""`moetrain simulate --figure`: the predicted speedup of hsdp-delayed over hsdp against replica groups and cost CV.

The step model comes in as `step_times` (`simulate.simulate_step_times`), so this module needs only
the cost draws and matplotlib, and `simulate` can call it. It draws; it must not simulate on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from moetrain.bench.costs import CostSpec, draw_costs

matplotlib.use("Agg")  # figures go to files only; never needs a display


def speedup_delayed_over_hsdp(step_times: Callable, spec: CostSpec, replicate: int, shard: int, accum: int,
                              samples: int, seed: int, workload, comm) -> float:
    compute = draw_costs(spec, seed, samples, accum, replicate)
    hsdp = step_times(compute, replicate, shard, "hsdp", workload, comm).mean()
    delayed = step_times(compute, replicate, shard, "hsdp-delayed", workload, comm).mean()
    return float(hsdp / delayed)


def draw_figure(opts, path: str, step_times: Callable) -> dict[str, list[float]]:
    """Both panels for `opts` (simulate.SimulateOptions) into `path`; returns the plotted numbers."""
    samples = min(opts.samples, 500)
    by_groups = [speedup_delayed_over_hsdp(step_times, opts.cost, r, opts.shard, opts.accum, samples, opts.seed,
                                           opts.workload, opts.comm) for r in opts.group_counts]
    lognormal = [CostSpec("lognormal", opts.cost.mean(), cv=cv) for cv in opts.cvs]
    by_cv = [speedup_delayed_over_hsdp(step_times, spec, opts.replicate, opts.shard, opts.accum, samples, opts.seed,
                                       opts.workload, opts.comm) for spec in lognormal]
    fig, (ax_groups, ax_cv) = plt.subplots(1, 2, figsize=(10, 4))
    ax_groups.plot(opts.group_counts, by_groups, marker="o")
    ax_groups.set_xscale("log", base=2)
    ax_groups.set_xlabel(f"replica groups (x {opts.shard} shards)")
    ax_groups.set_ylabel("predicted step-time ratio hsdp / hsdp-delayed")
    ax_groups.set_title(f"{opts.cost.distribution} costs (CV {opts.cost.std() / opts.cost.mean():.2f}), "
                        f"accum {opts.accum}")
    ax_cv.plot(opts.cvs, by_cv, marker="o")
    ax_cv.set_xlabel("cost coefficient of variation (lognormal)")
    ax_cv.set_title(f"{opts.replicate} x {opts.shard} ranks, accum {opts.accum}")
    for ax in (ax_groups, ax_cv):
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"moetrain simulate: overlap={opts.workload.overlap}, {opts.comm.algorithm}, "
                 f"{opts.workload.grad_bytes / 1e9:g} GB grads / {opts.workload.layers} units")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"group_counts": list(opts.group_counts), "speedup_by_groups": by_groups, "cvs": list(opts.cvs),
            "speedup_by_cv": by_cv}
