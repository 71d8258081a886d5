"""`moetrain bench sync`'s statistics and output: summary, text report, JSON, charts.

`summarise` turns the ranks' raw measurements into per-mode step times, paired
bootstrap ratios to `REFERENCE` and the simulator's prediction on the same drawn costs
(calibrated by `sync_calibration`); `report` prints it, writes the JSON and draws the
chart; `summarize_runs` tabulates several saved runs. This module only reads numbers
already measured: it must not run ranks, collectives or models.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from moetrain.args import read_input_json
from moetrain.bench import results_dir
from moetrain.bench.simulate import MODES, CommModel, Link, Workload
from moetrain.bench.sync_calibration import costs_in_seconds, fit_per_call_overhead, step_model
from moetrain.bench.sync_model import items_per_microbatch
from moetrain.bench.sync_options import REFERENCE, SyncBenchOptions

matplotlib.use("Agg")  # charts go to files only; never needs a display

RESULTS_DIR = results_dir()


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


def summarise(opts: SyncBenchOptions, raw: dict) -> dict:
    """The bench's JSON result from rank 0's raw measurements: per-mode statistics, calibration, prediction."""
    steps, modes = opts.steps, list(opts.modes)
    step_s = {m: np.zeros(steps) for m in modes}
    wait_s = {m: np.zeros(steps) for m in modes}
    measured_compute = np.zeros((steps, opts.accum, opts.replicate))
    for k, mode, gathered in raw["records"]:
        step_s[mode][k] = gathered[:, 0].max()  # the step ends when its last rank does
        wait_s[mode][k] = float(np.mean(gathered[:, 0] - gathered[:, 1]))
        if mode == REFERENCE:
            per_rank = gathered[:, 2:]  # [world, accum]; under PP a replica group's compute is its stages' sum
            by_rank = per_rank.reshape(opts.pp, opts.replicate, opts.shard, opts.accum).sum(axis=0)
            measured_compute[k] = by_rank.mean(axis=1).T
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
    simulate = step_model(opts)
    predicted = {m: simulate(drawn_seconds, opts.replicate, opts.shard, m, workloads[m], comm) for m in modes}
    from_trace = {m: simulate(measured_compute, opts.replicate, opts.shard, m, workloads[m], comm) for m in modes}
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
             f"{opts['replicate']} replica groups x {opts['shard']} shards{_pipeline_label(opts)}, "
             f"accum {opts['accum']}, "
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
    """Bar chart of each mode's mean step-time ratio to the reference (95% CI) with the simulator's ratio."""
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
    pipeline = f"_pp{opts.pp}_{opts.pp_schedule}" if opts.pp > 1 else ""
    return str(RESULTS_DIR / f"sync_{opts.cost_model}_{opts.cost.distribution}_{opts.replicate}x{opts.shard}"
                             f"{pipeline}_acc{opts.accum}.png")


def report(opts: SyncBenchOptions, raw: dict) -> dict:
    """Summarise, print the text report, draw the chart and write the JSON the options ask for."""
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
    mesh = f"{opts['replicate']}x{opts['shard']}{_pipeline_label(opts)}"
    return f"{opts['cost_model']} {shape}, {mesh}, acc {opts['accum']}"


def _pipeline_label(opts: dict) -> str:
    """", pipelines of pp N (schedule)" for a PP run (older JSONs have no pp: 1)."""
    return f", pipelines of pp {opts['pp']} ({opts['pp_schedule']})" if opts.get("pp", 1) > 1 else ""


def summarize_runs(paths: tuple[str, ...], figure: str | None) -> str:
    """Markdown table (and chart) of measured vs predicted step-time ratios over several bench runs."""
    results = []
    for path in paths:
        results.append(read_input_json(path, "--summarize"))
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
