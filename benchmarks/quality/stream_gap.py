"""Two rows of the quality grid compared on the training stream and on the held-out set, window by window.

Reads only the grid's `summary.json` files (no runs, no torch). For each summary, each seed both rows
ran, and each of `--windows` equal spans of the run, it prints the mean of row A's training loss
minus row B's over the logged steps of the span (paired: the same step, so the same batch), in
nats per token and in bits per byte (byte tokens: one token per byte), and the held-out bits per
byte of both rows at every evaluation.

Why the training stream: a run reads every training sequence once (1600 steps x 4 sequences of the
embedded corpus's 21,281), so a step's loss, taken before that step's update, is the loss on
unseen text of the training distribution, and a span averages tens of thousands of tokens of it.
The held-out set is 32 fixed sequences (16,384 tokens) from 41 held-out files whose byte
distribution differs from the training files' (unigram entropy 4.34 against 4.70 bits), so it can
rank two close models differently from the stream.

    python benchmarks/quality/stream_gap.py benchmarks/results/quality_800/summary.json \
        benchmarks/results/quality_1600/summary.json --windows 8 \
        --out benchmarks/results/quality_1600/stream_gap.md --plot benchmarks/results/quality_1600/stream_gap.png

Analysis only: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the headless backend)


def _row(summary: dict, name: str) -> dict:
    for row in summary["rows"]:
        if row["name"] == name:
            return row
    raise SystemExit(f"stream_gap: row {name!r} is not in the summary (rows: {[r['name'] for r in summary['rows']]})")


def window_gaps(loss_a: list, loss_b: list, steps: int, windows: int) -> list[tuple[int, int, float]]:
    """(first step, last step, mean of A - B) over the paired logged steps of each equal span."""
    b_at = dict((int(s), v) for s, v in loss_b)
    paired = [(int(s), v - b_at[int(s)]) for s, v in loss_a if int(s) in b_at]
    width = steps / windows
    out = []
    for w in range(windows):
        lo, hi = round(w * width) + 1, round((w + 1) * width)
        gaps = [g for s, g in paired if lo <= s <= hi]
        out.append((lo, hi, statistics.mean(gaps) if gaps else float("nan")))
    return out


@dataclass
class Pair:
    """Rows A and B of one summary, with each shared seed's span gaps computed once."""

    name: str
    steps: int
    row_a: dict
    row_b: dict
    gaps: dict[str, list[tuple[int, int, float]]]


def load_pair(path: Path, a: str, b: str, windows: int) -> Pair:
    summary = json.loads(path.read_text())
    steps = summary["method"]["steps"]
    row_a, row_b = _row(summary, a), _row(summary, b)
    gaps = {seed: window_gaps(row_a["seeds"][seed]["loss_curve"], row_b["seeds"][seed]["loss_curve"], steps, windows)
            for seed in row_a["seeds"] if seed in row_b["seeds"]}
    return Pair(path.parent.name, steps, row_a, row_b, gaps)


def plot(pairs: list[Pair], a: str, b: str, out: Path) -> None:
    """The training-stream gap per span against the step, one line per summary and seed."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for pair, style in zip(pairs, ("o--", "s-", "^-."), strict=False):
        for seed, gaps in pair.gaps.items():
            ax.plot([(lo + hi) / 2 for lo, hi, _ in gaps], [g / math.log(2) for _, _, g in gaps], style,
                    label=f"{pair.steps}-step run, seed {seed}")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("step (middle of the span)")
    ax.set_ylabel(f"{a} - {b}, bits/byte")
    ax.set_title(f"training-stream loss gap (above 0: {b} lower)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def report(pairs: list[Pair], a: str, b: str) -> str:
    lines = [f"Row A = {a}, row B = {b}. Training-stream gap = A's loss - B's on the same steps (negative: A "
             "lower); held-out: bits per byte.", ""]
    for pair in pairs:
        seeds = list(pair.gaps)
        lines.append(f"### {pair.name}: {pair.steps} steps, seeds {', '.join(seeds)}")
        lines.append("")
        spans = [f"{lo}-{hi}" for lo, hi, _ in next(iter(pair.gaps.values()), [])]
        lines.append("| training-stream gap, steps | " + " | ".join(spans) + " |")
        lines.append("|---|" + "---|" * len(spans))
        for seed, gaps in pair.gaps.items():
            lines.append(f"| seed {seed}, nats/token | " + " | ".join(f"{g:+.4f}" for _, _, g in gaps) + " |")
            lines.append(f"| seed {seed}, bits/byte | " + " | ".join(f"{g / math.log(2):+.4f}" for _, _, g in gaps)
                         + " |")
        lines.append("")
        evals = sorted({int(s) for seed in seeds for s, _ in pair.row_a["seeds"][seed]["eval_curve"]})
        lines.append("| held-out bits/byte, step | " + " | ".join(str(s) for s in evals) + " |")
        lines.append("|---|" + "---|" * len(evals))
        for name, row in ((a, pair.row_a), (b, pair.row_b)):
            for seed in seeds:
                at = {int(s): v for s, v in row["seeds"][seed]["eval_curve"]}
                lines.append(f"| {name}, seed {seed} | " + " | ".join(f"{at[s]:.3f}" if s in at else "-" for s in evals)
                             + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summaries", nargs="+", type=Path, help="summary.json files written by grid.py")
    parser.add_argument("--a", default="dense_active", help="row A (default: dense_active)")
    parser.add_argument("--b", default="moe_default", help="row B (default: moe_default)")
    parser.add_argument("--windows", type=int, default=4, help="equal spans per run (default: 4)")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables to this file")
    parser.add_argument("--plot", type=Path, default=None, help="also draw the gaps to this PNG")
    args = parser.parse_args(argv)
    pairs = [load_pair(path, args.a, args.b, args.windows) for path in args.summaries]
    text = report(pairs, args.a, args.b)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.plot:
        plot(pairs, args.a, args.b, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
