"""`moetrain plot RUN_DIR [--out PNG]`: a run's loss, held-out bits per byte, throughput, learning rate and
gradient norm (resumes marked), drawn from its metrics.

Reads `RUN_DIR/metrics.jsonl` (the last record wins for a repeated (kind, step): the
one that led to the final model) and draws five panels to a PNG (loss, bits per byte, throughput,
learning rate, gradient norm), six when the run scored downstream tasks (`train.eval_tasks`: acc and
acc_norm per task against step), with a dashed line at each resume. A run with MoE layers
also gets a second figure of expert load per MoE layer against step (max/mean, coefficient
of variation, experts without a token, and the aux-loss-free bias range when present),
written next to the first as `<stem>_experts.png`. This module only reads and draws; it
never writes into a run except the figures it is asked for.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import tyro
from matplotlib.figure import Figure

from moetrain.args import check_output_path, parse_typed_args
from moetrain.errors import ConfigError
from moetrain.runtime.run_dir import METRICS_FILE, RunDir


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file but the superseded ones; the last one wins for a repeated (kind, step)."""
    latest: dict[tuple[str, Any], dict[str, Any]] = {}
    order: list[tuple[str, Any]] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text (bad byte at offset {err.start}): not a metrics file") from None
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            # A run killed mid-write can leave a truncated last line; anything else is a real problem.
            if line_no == len(lines):
                continue
            raise ConfigError(f"{path}:{line_no} is not a JSON record") from None
        if not isinstance(record, dict) or record.get("superseded"):
            continue  # a history a resumed run left (moetrain.observe.metrics.mark_superseded)
        key = (record.get("kind", ""), record.get("step", line_no) if record.get("kind") != "event" else line_no)
        if key not in latest:
            order.append(key)
        latest[key] = record
    return [latest[k] for k in order]


def series(records: list[dict[str, Any]], kind: str, key: str) -> tuple[list[int], list[float]]:
    rows = sorted((r["step"], r[key]) for r in records if r.get("kind") == kind and key in r
                  and isinstance(r.get(key), (int, float)) and math.isfinite(r[key]))
    return [s for s, _ in rows], [v for _, v in rows]


def per_layer_series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[list[float]]]:
    """Steps and, for each MoE layer, the values of a per-layer train field (`key` holds one value per layer)."""
    rows = sorted((r["step"], r[key]) for r in records if r.get("kind") == "train" and isinstance(r.get(key), list))
    if not rows:
        return [], []
    n_layers = min(len(values) for _, values in rows)
    return [s for s, _ in rows], [[values[layer] for _, values in rows] for layer in range(n_layers)]


EXPERT_PANELS = (
    ("expert_load_max_over_mean_per_layer", "max / mean load", "busiest expert over the mean"),
    ("expert_load_cv_per_layer", "coefficient of variation", "expert load CV (std / mean)"),
    ("experts_without_tokens_per_layer", "experts", "experts without a token"),
    ("expert_bias_range_per_layer", "max - min bias", "aux-free expert bias range"),
)


PANEL_COLUMNS = 3  # panels per row: a figure about 1650 px wide at the saved dpi, readable without zooming


def panel_grid(n: int) -> tuple[Figure, list[Any]]:
    """A figure of `n` panels in rows of PANEL_COLUMNS (5 x 4.2 in each), the unused cells of the last row removed."""
    rows = -(-n // PANEL_COLUMNS)
    columns = min(n, PANEL_COLUMNS)
    fig = Figure(figsize=(5 * columns, 4.2 * rows))
    grid = list(fig.subplots(rows, columns, squeeze=False).flat)
    for ax in grid[n:]:
        ax.remove()
    return fig, grid[:n]


def expert_load_figure(records: list[dict[str, Any]], title: str) -> Figure | None:
    """Expert load per MoE layer against step (one line per layer), or None when no record has it."""
    panels = [(key, ylabel, panel_title, *per_layer_series(records, key)) for key, ylabel, panel_title in EXPERT_PANELS]
    panels = [panel for panel in panels if panel[3]]
    if not panels:
        return None
    fig, axes = panel_grid(len(panels))
    for ax, (_key, ylabel, panel_title, steps, layers) in zip(axes, panels):
        for index, values in enumerate(layers):
            ax.plot(steps, values, linewidth=1, label=f"MoE layer {index}")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(panel_title)
        ax.set_ylim(bottom=0)
    axes[0].legend(loc="upper right", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def draw_task_panel(ax, records: list[dict[str, Any]], task_keys: list[str]) -> None:
    """acc (solid) and acc_norm (dashed) of each in-loop task against step, one colour per task."""
    tasks = sorted({key.split("/")[1] for key in task_keys})
    for index, task in enumerate(tasks):
        colour = f"C{index % 10}"
        for metric, style in (("acc", "o-"), ("acc_norm", "s--")):
            steps, values = series(records, "tasks", f"task/{task}/{metric}")
            if steps:
                ax.plot(steps, values, style, color=colour, label=f"{task} {metric}")
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    ax.set_title("downstream tasks")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right", fontsize="small")


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Draw loss (train, held-out), held-out bits per byte and throughput against step to a PNG.

    With MoE layers also the expert-load figure, beside it as `<stem>_experts.png`; returns the paths written.
    """
    run_dir = Path(run_dir)
    path = RunDir(run_dir).metrics
    if not path.is_file():
        raise ConfigError(f"run directory {str(run_dir)!r} has no {METRICS_FILE}; pass the logging.run_dir "
                          "of a training run")
    records = read_records(path)
    if not series(records, "train", "loss")[0]:
        raise ConfigError(f"{path} has no training records yet")
    final = next((r for r in reversed(records) if r.get("kind") == "final"), {})

    fig = curve_figure(records, final, f"moetrain run {run_dir.name}")
    out_path = Path(out) if out is not None else RunDir(run_dir).curve
    _save_figure(fig, out_path)
    written = [out_path]
    experts = expert_load_figure(records, f"moetrain run {run_dir.name}: expert load per MoE layer")
    if experts is not None:
        written.append(out_path.with_name(f"{out_path.stem}_experts{out_path.suffix}"))
        _save_figure(experts, written[-1])
    return written


def _save_figure(fig: Figure, path: Path) -> None:
    """Write `fig` to `path` (parents created); one ConfigError line when it cannot be written there."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise ConfigError(f"--out {str(path)!r} cannot be written: {err.strerror or err} "
                          f"({err.filename or path}); choose a writable file path") from None
    except ValueError as err:  # matplotlib: an unknown file extension
        raise ConfigError(f"--out {str(path)!r} cannot be written: {str(err).splitlines()[0]}") from None


def resume_steps(records: list[dict[str, Any]]) -> list[int]:
    """The steps a run resumed at (its "resume" events)."""
    return [r["step"] for r in records if r.get("kind") == "event" and r.get("event") == "resume"]


def curve_figure(records: list[dict[str, Any]], final: dict[str, Any], title: str) -> Figure:
    """Loss, held-out bits per byte, throughput, learning rate and gradient norm against step; every
    panel marks the steps the run resumed at."""
    train_steps, train_loss = series(records, "train", "loss")
    eval_steps, eval_loss = series(records, "eval", "heldout_loss")
    _, eval_bpb = series(records, "eval", "heldout_bpb")
    tput_steps, tput = series(records, "train", "tokens_per_s")
    _, train_avg = series(records, "train", "loss_avg")
    lr_steps, lr = series(records, "train", "lr")
    norm_steps, grad_norm = series(records, "train", "grad_norm")
    entropy = final.get("unigram_entropy_bits")
    # A bare Figure (no pyplot): no global state, no GUI backend, works on machines without a display.
    task_keys = sorted({k for r in records if r.get("kind") == "tasks" for k in r if k.startswith("task/")})
    fig, axes = panel_grid(6 if task_keys else 5)
    ax_loss, ax_bpb, ax_tput, ax_lr, ax_norm, *ax_tasks = axes
    if task_keys:
        draw_task_panel(ax_tasks[0], records, task_keys)
    ax_loss.plot(train_steps, train_loss, color="tab:blue", alpha=0.35, linewidth=0.8, label="train loss (log step)")
    if len(train_avg) == len(train_steps):
        ax_loss.plot(train_steps, train_avg, color="tab:blue", label="train loss (mean since last log)")
    if eval_steps:
        ax_loss.plot(eval_steps, eval_loss, "o-", color="tab:orange", label="held-out loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats per token)")
    ax_loss.set_title("loss")
    ax_loss.legend(loc="upper right")
    if eval_steps:
        ax_bpb.plot(eval_steps, eval_bpb, "o-", color="tab:green", label="held-out bits per byte")
    if entropy is not None:
        ax_bpb.axhline(entropy, color="gray", linestyle=":", label=f"unigram byte entropy ({entropy:.2f})")
    ax_bpb.set_xlabel("step")
    ax_bpb.set_ylabel("bits per byte")
    ax_bpb.set_title("held-out bits per byte")
    ax_bpb.set_ylim(bottom=0)
    if eval_steps or entropy is not None:
        ax_bpb.legend(loc="lower left")
    ax_tput.plot(tput_steps, tput, color="tab:purple")
    ax_tput.set_xlabel("step")
    ax_tput.set_ylabel("tokens / s (global)")
    ax_tput.set_title("throughput")
    ax_tput.set_ylim(bottom=0)
    ax_lr.plot(lr_steps, lr, color="tab:red")
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_title("learning rate")
    ax_norm.plot(norm_steps, grad_norm, color="tab:brown")
    ax_norm.set_xlabel("step")
    ax_norm.set_ylabel("global gradient norm (before clipping)")
    ax_norm.set_title("gradient norm")
    for ax in (ax_loss, ax_bpb, ax_tput, ax_lr, ax_norm):
        for index, step in enumerate(resume_steps(records)):
            ax.axvline(step, color="black", linestyle="--", linewidth=0.8, label="resumed" if index == 0 else None)
    if resume_steps(records):
        ax_lr.legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


@dataclass
class PlotOptions:
    """Draw a run's loss and throughput curves to a PNG."""

    run_dir: Annotated[str, tyro.conf.Positional]  # the run directory (logging.run_dir of the training job)
    out: str | None = None  # PNG path (default RUN_DIR/training_curve.png)


def main(argv: list[str]) -> int:
    opts = parse_typed_args(PlotOptions, argv, "moetrain plot", bool_flags=True)
    if opts.out is not None:  # before drawing: a figure takes a second
        check_output_path(opts.out, "--out")
    for path in plot_run(opts.run_dir, opts.out):
        print(path)
    return 0
