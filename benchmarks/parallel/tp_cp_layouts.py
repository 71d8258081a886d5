"""Peak memory per rank and step time of TP 2 x FSDP 2 and CP 2 x FSDP 2 against FSDP 4, at 4 K and 16 K tokens per row.

Each (layout, row length) is a fresh 4-rank `torchrun` job of `moetrain bench train` (its median timed step,
its peak RSS per rank), run by `pp_layouts.run`; within a row length the layouts alternate round by round
(A B C, then C B A) so drift on a shared machine hits them alike. Every layout trains the same global batch:
4 rows of one sequence each per step (FSDP 4: one per data rank; TP 2 / CP 2: 2 data ranks x 2 accumulated
microbatches). The model is configs/tiny_moe.toml made smaller (`--extra`) so a 16 K row trains in minutes,
with what TP/CP need (no sampling, the global-batch aux loss) set for every layout alike.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/parallel/tp_cp_layouts.py --rounds 2 \
        --out benchmarks/results/tp_cp_layouts.json --plot benchmarks/results/tp_cp_layouts.png

Writes the runs and medians as JSON, a markdown table beside it (.md) and a two-panel plot. Benchmark only:
it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.parallel.pp_layouts import run

LAYOUTS = {"fsdp4": ["--train.grad_accum", "1"],
           "tp2_fsdp2": ["--train.grad_accum", "2", "--parallel.tp", "2"],
           "cp2_fsdp2": ["--train.grad_accum", "2", "--parallel.cp", "2"]}
COMMON = ("--model.dim 128 --model.n_layers 2 --model.ffn_hidden 256 --model.moe.n_experts 8 "
          "--model.moe.expert_hidden 64 --train.microbatch_size 1 --train.sample_tokens 0 "
          "--model.moe.aux_loss_scope global_batch")


def table(medians: dict[str, dict[str, dict[str, float]]]) -> str:
    rows = ["| tokens per row | layout | step (s) | tokens/s | peak RSS per rank (MiB) | vs FSDP 4 (memory) |",
            "|---|---|---|---|---|---|"]
    for seq, layouts in medians.items():
        base = layouts["fsdp4"]["peak_rss_mib"]
        for name, row in layouts.items():
            rows.append(f"| {seq} | {name} | {row['step_s']:.2f} | {row['tokens_per_s']:.0f} | "
                        f"{row['peak_rss_mib']:.0f} | {row['peak_rss_mib'] / base:.2f} |")
    return "\n".join(rows)


def plot(medians: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(LAYOUTS)
    width = 0.8 / len(medians)
    for i, (seq, layouts) in enumerate(medians.items()):
        xs = [j + i * width for j in range(len(names))]
        axes[0].bar(xs, [layouts[n]["peak_rss_mib"] for n in names], width, label=f"{seq} tokens/row")
        axes[1].bar(xs, [layouts[n]["step_s"] for n in names], width, label=f"{seq} tokens/row")
    for ax, title in zip(axes, ("peak RSS per rank (MiB)", "step time (s), shared 2-core machine"), strict=True):
        ax.set_xticks([j + width * (len(medians) - 1) / 2 for j in range(len(names))], names)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny_moe.toml")
    parser.add_argument("--seqs", default="4096,16384")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--extra", default=COMMON, help="overrides every layout gets")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    opts = parser.parse_args()
    runs: dict[str, dict[str, list[dict]]] = {}
    for seq in opts.seqs.split(","):
        runs[seq] = {name: [] for name in LAYOUTS}
        rows = ["--data.seq_len", seq, "--model.max_seq_len", seq]
        for round_ in range(opts.rounds):
            for name in list(LAYOUTS) if round_ % 2 == 0 else list(LAYOUTS)[::-1]:
                result = run(LAYOUTS[name] + rows + opts.extra.split(), opts.config, opts.steps)
                runs[seq][name].append({
                    "step_s": result["step_s_median"], "tokens_per_s": result["tokens_per_s"],
                    "peak_rss_mib": max(m["peak_rss_bytes"] for m in result["memory_per_rank"]) / 2**20,
                    "tokens_per_step": result["tokens_per_step"]})
                print(seq, name, runs[seq][name][-1], flush=True)
    medians = {seq: {name: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
                     for name, rows in layouts.items()} for seq, layouts in runs.items()}
    print(table(medians))
    if opts.out:
        opts.out.write_text(json.dumps({"extra": opts.extra, "runs": runs, "medians": medians}, indent=1) + "\n")
        opts.out.with_suffix(".md").write_text(table(medians) + "\n")
    if opts.plot:
        plot(medians, opts.plot)


if __name__ == "__main__":
    main()
