"""Does moetrain train good MoE models? A quality grid on the embedded corpus, two seeds per row.

Every row is `moetrain train --config configs/tiny_moe.toml` plus a few overrides (the row's
architecture or balancing choice), run as a fresh subprocess with one intra-op thread, no sample,
no checkpoints and evaluation every `--eval-every` steps on the same `--eval-batches` held-out
sequences. All rows of one seed see the same training tokens in the same order (the loader's
unit i of step s depends on (seed, s, i) only, whatever the microbatch split). The schedule keeps
the default job's shape (cosine, warmup 40/800 of the steps) at `--steps` steps.

Rows (the default MoE: first layer dense FFN 512, three MoE layers of 16 experts top-2 width 128):
  dense_active   all four layers dense, FFN width chosen so active matmul params match the MoE's
  dense_total    all four layers dense, FFN width chosen so total params match the MoE's
  moe_default    configs/tiny_moe.toml as it is (= granularity (16, 2, 128), aux loss per microbatch)
  gran_8x1x256, gran_32x4x64, gran_64x8x32   same active and total expert parameters as the default
  shared_1       one shared expert (width 128) + 15 routed top-1: same active and total as the default
  bal_aux_free, bal_none                      default architecture, other balancing
  bal_aux_mb_acc4, bal_aux_global_acc4        microbatch 1 x grad_accum 4 (same tokens per step), so
                                              "per microbatch" (512 tokens) and "global batch" (2048) differ
  bal_aux_free_fast                           aux-loss-free bias at rate 1e-2 instead of the default 1e-3
  dense_total_lr1e-3                          dense_total at a third of the default learning rate
  moe_muon, dense_active_muon                 the MoE and its active-parameter dense twin with train.optimizer =
                                              "muon" (Muon on attention, dense FFN and expert matrices, AdamW
                                              on the rest, the default lr and weight decay carried over)
  moe_muon_router_lr0.3                       moe_muon with the router's learning rate at 0.3x (train.lr_scale)
  moe_experts_lr2, moe_muon_experts_lr2       the MoE with its experts' learning rate at 2x, AdamW and Muon
  moe_muon_gran_32x4x64                       32 experts, top-4, width 64 (the same active parameters) with Muon

  mtp_1_l0.3                                  the default plus one multi-token-prediction module, λ = 0.3
  gran_8x1x256_renorm (diagnostic)            top-1 with renormalized gates: every gate is 1, so the router
                                              learns from the aux loss only; moetrain's config validation
                                              now refuses it, so the grid no longer runs it and reports
                                              runs measured before the refusal when the output has them

Resumable: a run whose metrics.jsonl holds a "final" record is not run again; the summary, table and
figures are rebuilt from whatever runs have finished, so a partial grid still gives a table.

    PYTHONPATH=src .venv/bin/python benchmarks/quality/grid.py --steps 300 --jobs 2
    PYTHONPATH=src .venv/bin/python benchmarks/quality/grid.py --quick --out quality_quick

Benchmark only: nothing here asserts a number. `--quick` runs a few rows for a handful of steps on a
shrunken sequence length, to check that the pipeline produces its outputs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from moetrain.config.job import JobConfig, apply_overrides, load
from moetrain.model.flops import count_params, flops_per_token

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_moe.toml"


@dataclass(frozen=True)
class Row:
    name: str
    group: str
    label: str
    overrides: tuple[str, ...] = field(default_factory=tuple)
    microbatch_size: int = 4
    """Held-out evaluation reads eval_batches x microbatch_size evenly spaced sequences, so a row with
    smaller microbatches evaluates more batches to score the same sequences as every other row."""
    refused: str = ""
    """Why moetrain now refuses this row's config (it is not run; runs measured before the refusal,
    e.g. from an older checkout, are still read and reported as the evidence for it)."""


def _moe(n_experts: int, top_k: int, hidden: int, shared: int = 0, renormalize: bool | None = None) -> tuple[str, ...]:
    # Top-1 with renormalized gates makes every gate exactly 1 (g / g), so the router would get no
    # gradient from the language-model loss, only from the aux loss: top-1 rows use Switch's gate
    # (the softmax probability itself) unless a row asks otherwise.
    renormalize = top_k > 1 if renormalize is None else renormalize
    return ("--model.moe.n_experts", str(n_experts), "--model.moe.top_k", str(top_k),
            "--model.moe.expert_hidden", str(hidden), "--model.moe.n_shared_experts", str(shared),
            "--model.moe.renormalize", str(renormalize))


def dense_width(base: JobConfig, key: str) -> int:
    """The all-dense FFN width (multiple of 4) whose `key` parameter count is nearest the MoE's."""
    target = count_params(base.model)[key]
    best = None
    for width in range(4, 8192, 4):
        model = replace(base.model, n_dense_layers=base.model.n_layers, ffn_hidden=width)
        gap = abs(count_params(model)[key] - target)
        if best is None or gap < best[0]:
            best = (gap, width)
    return best[1]


MUON = ("--train.optimizer", "muon")


def rows(base: JobConfig) -> list[Row]:
    n_layers = str(base.model.n_layers)
    dense = ("--model.n_dense_layers", n_layers)
    acc4 = ("--train.microbatch_size", "1", "--train.grad_accum", "4")
    # In priority order: the grid runs row by row (both seeds of a row side by side), so a grid cut
    # short has the most important comparisons first.
    return [
        Row("moe_default", "headline", "MoE default (16 experts, top-2, width 128)"),
        Row("dense_active", "headline", "dense, MoE's active params",
            dense + ("--model.ffn_hidden", str(dense_width(base, "active_matmul")))),
        Row("bal_none", "balancing", "no balancing", ("--model.moe.load_balance", "none")),
        Row("bal_aux_free", "balancing", "aux-loss-free bias", ("--model.moe.load_balance", "aux_free")),
        Row("gran_64x8x32", "granularity", "64 experts, top-8, width 32", _moe(64, 8, 32)),
        Row("gran_8x1x256", "granularity", "8 experts, top-1, width 256 (Switch gate)", _moe(8, 1, 256)),
        Row("shared_1", "shared", "1 shared + 15 routed top-1, width 128 (Switch gate)", _moe(15, 1, 128, shared=1)),
        Row("dense_total", "headline", "dense, MoE's total params",
            dense + ("--model.ffn_hidden", str(dense_width(base, "total")))),
        Row("gran_32x4x64", "granularity", "32 experts, top-4, width 64", _moe(32, 4, 64)),
        Row("bal_aux_mb_acc4", "balancing", "aux loss per microbatch, 1x4 accumulation", acc4, 1),
        Row("bal_aux_global_acc4", "balancing", "global-batch aux loss, 1x4 accumulation",
            acc4 + ("--model.moe.aux_loss_scope", "global_batch"), 1),
        # The aux-free bias moves by at most its rate per step, so undoing a warm-up collapse (a score
        # gap near 1) takes about 1 / rate steps: 1e-3 needs longer than the run, 1e-2 does not.
        Row("bal_aux_free_fast", "balancing", "aux-loss-free bias, rate 1e-2",
            ("--model.moe.load_balance", "aux_free", "--model.moe.bias_update_rate", "0.01")),
        # Adam moves every weight by about the learning rate whatever the width, so a layer's output moves
        # with its fan-in: the wide dense model may want a smaller rate than the default's 3e-3.
        Row("dense_total_lr1e-3", "headline", "dense, MoE's total params, lr 1e-3",
            dense + ("--model.ffn_hidden", str(dense_width(base, "total")), "--train.lr", "1e-3")),
        Row("moe_muon", "optimizer", "MoE default, Muon", MUON),
        Row("dense_active_muon", "optimizer", "dense, MoE's active params, Muon",
            dense + ("--model.ffn_hidden", str(dense_width(base, "active_matmul"))) + MUON),
        Row("moe_muon_router_lr0.3", "optimizer", "MoE default, Muon, router lr 0.3x",
            MUON + ("--train.lr_scale.router", "0.3")),
        # Each expert sees about top_k / n_experts of the tokens, so its weights get fewer updates with signal
        # than a dense layer's: a larger rate for the expert group is the per-group lever to try first.
        Row("moe_experts_lr2", "optimizer", "MoE default, experts lr 2x", ("--train.lr_scale.experts", "2")),
        Row("moe_muon_experts_lr2", "optimizer", "MoE default, Muon, experts lr 2x",
            MUON + ("--train.lr_scale.experts", "2")),
        # Finer experts at the same active parameters (DeepSeek's granularity argument): under AdamW at 200 steps
        # 32 x top-4 tied the default, so the row asks whether Muon, which lifts every expert's update to full
        # rank, turns the extra routing combinations into a lead over the dense twin.
        Row("moe_muon_gran_32x4x64", "optimizer", "32 experts, top-4, width 64, Muon", _moe(32, 4, 64) + MUON),

        # Multi-token prediction (DeepSeek-V3): one MTP module trained at λ = 0.3 beside the default model; held-out
        # bits/byte is the main head's, so the row asks whether the extra objective helps next-token prediction.
        Row("mtp_1_l0.3", "mtp", "default + MTP depth 1, λ = 0.3",
            ("--model.mtp_depth", "1", "--train.mtp_loss_weight", "0.3")),
        Row("gran_8x1x256_renorm", "diagnostic", "8 experts, top-1, renormalized gate = 1 (router: aux loss only)",
            _moe(8, 1, 256, renormalize=True),
            refused="config validation refuses model.moe.top_k = 1 with model.moe.renormalize = True"),
    ]


QUICK_ROWS = ("moe_default", "dense_active")


def schedule_args(row: Row, steps: int, eval_every: int, eval_batches: int, seed: int, quick: bool) -> list[str]:
    eval_batches = eval_batches * 4 // row.microbatch_size
    warmup = max(1, round(40 * steps / 800))  # the default job's warmup fraction
    args = ["--train.steps", str(steps), "--train.warmup_steps", str(warmup),
            "--train.eval_every", str(eval_every), "--train.eval_batches", str(eval_batches),
            "--train.sample_tokens", "0", "--train.num_threads", "1", "--train.seed", str(seed),
            "--checkpoint.enabled", "False", "--logging.progress_bar", "False",
            "--logging.log_every", str(max(1, min(5, steps // 4)))]
    if quick:
        args += ["--data.seq_len", "64", "--data.max_documents", "60"]
    return args


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a run killed mid-line
            break
    return records


def finished(run_dir: Path, steps: int) -> bool:
    """The run's final record exists and is at `steps` (a run of another length is run again)."""
    return any(r.get("kind") == "final" and r["step"] == steps for r in read_records(run_dir / "metrics.jsonl"))


def run_one(row: Row, seed: int, steps: int, extra: list[str], run_dir: Path, python: str) -> str:
    if finished(run_dir, steps):
        return f"{run_dir.name}: already done"
    if run_dir.exists():  # an unfinished run: start it afresh (no checkpoints are kept)
        for child in run_dir.iterdir():
            child.unlink()
    command = [python, "-m", "moetrain", "train", "--config", str(CONFIG), *row.overrides, *extra,
               "--logging.run_dir", str(run_dir)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    start = time.time()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return f"{run_dir.name}: FAILED ({done.returncode}) {done.stderr[-2000:]}"
    return f"{run_dir.name}: {time.time() - start:.0f} s"


def summarize_run(records: list[dict]) -> dict:
    train = [r for r in records if r.get("kind") == "train"]
    evals = {r["step"]: r["heldout_bpb"] for r in records if r.get("kind") == "eval"}
    final = next(r for r in records if r.get("kind") == "final")
    half = len(train) // 2
    early, later = train[:half] or train, train[half:] or train  # the two halves of training
    out = {
        "heldout_bpb": final["heldout_bpb"], "wall_s": final["wall_s"],
        "eval_curve": sorted(evals.items()),
        "loss_curve": [(r["step"], r["loss"]) for r in train],
        "last_train_loss_avg": train[-1]["loss_avg"] if train else None,
    }
    if train and "expert_load_cv" in train[0]:
        out["load_cv_curve"] = [(r["step"], r["expert_load_cv"]) for r in train]
        out["idle_curve"] = [(r["step"], r["experts_without_tokens"]) for r in train]
        out["load_cv_first_half"] = statistics.mean(r["expert_load_cv"] for r in early)
        out["load_cv_second_half"] = statistics.mean(r["expert_load_cv"] for r in later)
        out["idle_first_half"] = statistics.mean(r["experts_without_tokens"] for r in early)
        out["idle_second_half"] = statistics.mean(r["experts_without_tokens"] for r in later)
        # The worst layer's max / mean expert load in any logged step: 1 when even, E / top_k when
        # one expert takes every token (a token visits an expert at most once).
        out["peak_max_over_mean"] = max(max(r["expert_load_max_over_mean_per_layer"]) for r in train)
        out["max_over_mean_second_half"] = statistics.mean(r["expert_load_max_over_mean"] for r in later)
        out["aux_loss_last"] = train[-1]["aux_loss"]
        if "expert_bias_range" in train[-1]:
            out["bias_range_last"] = train[-1]["expert_bias_range"]
    return out


def summarize(grid_rows: list[Row], base: JobConfig, seeds: list[int], runs: Path, seq_len: int,
              steps: int) -> dict:
    summary = {"rows": []}
    for row in grid_rows:
        # A refused row's sizes are those of its config with the refused option flipped (renormalize
        # changes no parameter count or FLOP).
        overrides = [("False" if row.refused and o == "True" else o) for o in row.overrides]
        cfg = apply_overrides(base, overrides)
        params = count_params(cfg.model)
        entry = {"name": row.name, "group": row.group, "label": row.label, "overrides": list(row.overrides),
                 **({"refused": row.refused} if row.refused else {}),
                 "params_total": params["total"], "params_active": params["active"],
                 "flops_per_token": flops_per_token(cfg.model, seq_len), "seeds": {}}
        for seed in seeds:
            records = read_records(runs / f"{row.name}_s{seed}" / "metrics.jsonl")
            if any(r.get("kind") == "final" and r["step"] == steps for r in records):
                entry["seeds"][str(seed)] = summarize_run(records)
        values = [s["heldout_bpb"] for s in entry["seeds"].values()]
        if values:
            entry["heldout_bpb_mean"] = statistics.mean(values)
            entry["heldout_bpb_spread"] = max(values) - min(values)
            entry["wall_s_mean"] = statistics.mean(s["wall_s"] for s in entry["seeds"].values())
            for key in ("load_cv_first_half", "load_cv_second_half", "idle_first_half", "idle_second_half",
                        "max_over_mean_second_half", "peak_max_over_mean"):
                got = [s[key] for s in entry["seeds"].values() if key in s]
                if got:
                    entry[key] = statistics.mean(got)
        summary["rows"].append(entry)
    # Paired by seed (a seed fixes the init and the data order, shared by every row of that seed):
    # each row's held-out bpb minus the default MoE's. Negative: better than the default.
    default = next((e for e in summary["rows"] if e["name"] == "moe_default"), None)
    for e in summary["rows"]:
        if default is not None:
            common = sorted(set(e["seeds"]) & set(default["seeds"]))
            e["delta_vs_default_per_seed"] = {seed: e["seeds"][seed]["heldout_bpb"]
                                              - default["seeds"][seed]["heldout_bpb"] for seed in common}
    # Ranking stability: the order of the rows by held-out bpb under each seed alone.
    summary["ranking_per_seed"] = {}
    for seed in seeds:
        have = [(e["seeds"][str(seed)]["heldout_bpb"], e["name"]) for e in summary["rows"] if str(seed) in e["seeds"]]
        summary["ranking_per_seed"][str(seed)] = [name for _, name in sorted(have)]
    return summary


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(summary: dict) -> str:
    lines = ["| row | group | params total / active | MFLOPs/token | held-out bpb (mean ± half-spread) | seeds "
             "| per-seed bpb | per-seed Δ vs MoE default | load CV 1st / 2nd half | idle experts 1st / 2nd half "
             "| peak max/mean load | loop time s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary["rows"]:
        seeds = e["seeds"]
        per_seed = " / ".join(f"{s['heldout_bpb']:.3f}" for _, s in sorted(seeds.items()))
        bpb = (f"{e['heldout_bpb_mean']:.3f} ± {e['heldout_bpb_spread'] / 2:.3f}" if seeds
               else "refused" if e.get("refused") else "not run")
        delta = " / ".join(f"{d:+.3f}" for _, d in sorted(e.get("delta_vs_default_per_seed", {}).items()))
        lines.append(f"| {e['label']} | {e['group']} | {e['params_total'] / 1e6:.2f} M / "
                     f"{e['params_active'] / 1e6:.2f} M | {e['flops_per_token'] / 1e6:.1f} | {bpb} | {len(seeds)} "
                     f"| {per_seed or '-'} | {delta or '-'} | {fmt(e.get('load_cv_first_half'), '.2f')} / "
                     f"{fmt(e.get('load_cv_second_half'), '.2f')} | {fmt(e.get('idle_first_half'), '.1f')} / "
                     f"{fmt(e.get('idle_second_half'), '.1f')} | {fmt(e.get('peak_max_over_mean'), '.1f')} "
                     f"| {fmt(e.get('wall_s_mean'), '.0f')} |")
    lines.append("")
    for seed, order in summary["ranking_per_seed"].items():
        lines.append(f"seed {seed} ranking (best first): {', '.join(order)}")
    return "\n".join(lines) + "\n"


def save_figure(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figures(summary: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    done = [e for e in summary["rows"] if e["seeds"]]
    if not done:
        return written
    palette = plt.get_cmap("tab10" if len(done) <= 10 else "tab20")
    colors = {e["name"]: palette(i % palette.N) for i, e in enumerate(done)}
    # 1. Training-loss curves (smoothed) of every row, seed 0 solid, seed 1 dashed; held-out beside.
    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(15, 6))
    for e in done:
        for i, (_seed, s) in enumerate(sorted(e["seeds"].items())):
            steps = [p[0] for p in s["loss_curve"]]
            losses = [p[1] for p in s["loss_curve"]]
            smooth = [statistics.mean(losses[max(0, j - 4):j + 1]) for j in range(len(losses))]
            ax_train.plot(steps, smooth, color=colors[e["name"]], ls="-" if i == 0 else "--", lw=1.2,
                          label=e["label"] if i == 0 else None)
            evals = s["eval_curve"]
            ax_eval.plot([p[0] for p in evals], [p[1] for p in evals], color=colors[e["name"]],
                         ls="-" if i == 0 else "--", marker="o", ms=3, label=e["label"] if i == 0 else None)
    ax_train.set(xlabel="step", ylabel="training loss (nats/byte, 5-record mean)", title="training loss")
    ax_eval.set(xlabel="step", ylabel="held-out bits per byte", title="held-out bits per byte")
    for ax in (ax_train, ax_eval):
        ax.grid(alpha=0.3)
    evals_all = [p[1] for e in done for s in e["seeds"].values() for p in s["eval_curve"]]
    pad = 0.05 * (max(evals_all) - min(evals_all) or 1.0)
    ax_eval.set_ylim(min(evals_all) - pad, max(evals_all) + pad)
    ax_eval.legend(fontsize=7)
    fig.suptitle("moetrain quality grid: solid seed 0, dashed seed 1")
    written.append(save_figure(plt, fig, out / "curves.png"))
    # 2. Headline: final held-out bpb against training FLOPs per token, with the seed spread.
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for e in done:
        values = [s["heldout_bpb"] for s in e["seeds"].values()]
        x = e["flops_per_token"] / 1e6
        ax.errorbar([x], [e["heldout_bpb_mean"]], yerr=[[e["heldout_bpb_mean"] - min(values)],
                                                         [max(values) - e["heldout_bpb_mean"]]],
                    fmt="o" if e["group"] != "headline" else "s", color=colors[e["name"]], capsize=3,
                    label=e["label"])
    ax.set(xscale="log", xlabel="training FLOPs per token (M, model/flops.py)",
           ylabel="final held-out bits per byte (min-max over seeds)", title="quality vs compute per token")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    written.append(save_figure(plt, fig, out / "bpb_vs_flops.png"))
    # 3. Balancing: expert-load CV and idle experts over training.
    moe_rows = [e for e in done if any("load_cv_curve" in s for s in e["seeds"].values())]
    if moe_rows:
        fig, (ax_cv, ax_idle) = plt.subplots(1, 2, figsize=(14, 5))
        for e in moe_rows:
            for i, (_seed, s) in enumerate(sorted(e["seeds"].items())):
                ls = "-" if i == 0 else "--"
                ax_cv.plot([p[0] for p in s["load_cv_curve"]], [p[1] for p in s["load_cv_curve"]],
                           color=colors[e["name"]], ls=ls, lw=1, label=e["label"] if i == 0 else None)
                ax_idle.plot([p[0] for p in s["idle_curve"]], [p[1] for p in s["idle_curve"]],
                             color=colors[e["name"]], ls=ls, lw=1, label=e["label"] if i == 0 else None)
        ax_cv.set(xlabel="step", ylabel="expert-load coefficient of variation (mean over MoE layers)",
                  yscale="log", title="expert load CV")
        ax_idle.set(xlabel="step", ylabel="experts with no token in the step (all MoE layers)",
                    title="idle experts")
        for ax in (ax_cv, ax_idle):
            ax.grid(alpha=0.3)
        ax_cv.legend(fontsize=7)
        written.append(save_figure(plt, fig, out / "expert_load.png"))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each one intra-op thread)")
    parser.add_argument("--rows", nargs="*", default=None, help="only these rows (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="two rows, 6 steps, sequence length 64: checks the pipeline, not quality")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="train and evaluate on rows of this many tokens instead of the config's (a cheaper grid)")
    parser.add_argument("--report-only", action="store_true", help="rebuild summary, table and figures only")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quality"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.eval_batches = 6, 3, 1
    out = Path(args.out)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    base = load(CONFIG)
    grid_rows = rows(base)
    wanted = args.rows or (list(QUICK_ROWS) if args.quick else None)
    if wanted:
        unknown = set(wanted) - {r.name for r in grid_rows}
        if unknown:
            parser.error(f"unknown rows {sorted(unknown)}; known: {[r.name for r in grid_rows]}")
        grid_rows = [r for r in grid_rows if r.name in wanted]
    seq_len = 64 if args.quick else args.seq_len or base.data.seq_len
    shorter = ["--data.seq_len", str(seq_len)] if args.seq_len and not args.quick else []
    if not args.report_only:
        # Row-major: both seeds of a row run side by side (same cost, so they finish together).
        tasks = [(row, seed) for row in grid_rows for seed in args.seeds if not row.refused]
        for row in grid_rows:
            if row.refused:
                print(f"{row.name}: not run ({row.refused})", flush=True)
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(run_one, row, seed, args.steps,
                                   schedule_args(row, args.steps, args.eval_every, args.eval_batches, seed, args.quick)
                                   + shorter,
                                   runs / f"{row.name}_s{seed}", sys.executable) for row, seed in tasks]
            for future in futures:
                print(future.result(), flush=True)
    summary = summarize(grid_rows, base, args.seeds, runs, seq_len, args.steps)
    summary["method"] = {"config": str(CONFIG.relative_to(ROOT)), "steps": args.steps, "seeds": args.seeds,
                         "eval_every": args.eval_every, "eval_batches": args.eval_batches,
                         "warmup_steps": max(1, round(40 * args.steps / 800)), "quick": args.quick,
                         "seq_len": seq_len, "threads_per_run": 1, "runs_at_once": args.jobs}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "table.md").write_text(table(summary))
    for path in figures(summary, out):
        print(f"wrote {path}")
    print(table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
