"""Run one measurement in two trees, A and B, alternating A B B A ..., and report medians side by side.

The A/B scripts in this folder build on it; it also runs any command that writes a JSON report:

    PYTHONPATH=$PWD/src:$PWD python benchmarks/ab/runner.py --baseline ../main [--candidate .] \
        [--rounds 2] [--ranks 1] [--metric tokens_per_s --metric mfu] --out benchmarks/results/NAME \
        -- -m moetrain bench train --config configs/qwen3_moe_debug.toml --steps 3 --json {json}

A tree is a checkout with src/ (and configs/): each of its processes runs with the tree as working
directory and the tree's own src first on PYTHONPATH, then this checkout's root, so that a
script of this checkout (its workers) measures the other tree's code. `{json}` in a command is
replaced by a fresh temporary file the command writes its report to (`{tmp}` by a fresh
directory); otherwise the command prints one line starting with a marker and a JSON object.
Each process is fresh and the order flips every round, so drift on a shared machine hits both
trees alike. Reports: OUT.json (every run
and the medians), OUT.md (the table) and OUT.png (the first metric's medians and runs).

It measures and reports; it asserts nothing about time, and it does not check trees out: point
it at existing checkouts (`git worktree add ../base REV`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the headless backend)

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True)
class Tree:
    """One side of a comparison: a label, a checkout and the interpreter its processes run under."""

    label: str
    path: Path
    python: str = sys.executable
    args: tuple[str, ...] = field(default=())  # extra arguments this side appends to every command

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(self.path / "src"), str(REPO)]), **extra}


def two_trees(baseline: str | Path, candidate: str | Path = REPO, *, python_from_tree: bool = False,
              labels: tuple[str, str] = ("A", "B")) -> dict[str, Tree]:
    """A = the baseline checkout, B = the candidate (default: this checkout). `python_from_tree`: each
    tree's own .venv/bin/python instead of this interpreter."""
    trees = {}
    for label, path in zip(labels, (baseline, candidate), strict=True):
        root = Path(path).resolve()
        python = str(root / ".venv" / "bin" / "python") if python_from_tree else sys.executable
        trees[label] = Tree(label, root, python)
    return trees


def order(labels: Sequence[str], round_: int) -> list[str]:
    """The labels in round `round_`: as given in even rounds, reversed in odd ones."""
    return list(labels) if round_ % 2 == 0 else list(reversed(labels))


def alternate(labels: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, label) in the order A B, B A, A B, ...: each label runs first in every other round."""
    for round_ in range(rounds):
        for label in order(labels, round_):
            yield round_, label


def launcher(tree: Tree, ranks: int = 1) -> list[str]:
    """The interpreter, or torchrun over `ranks` local processes of it."""
    if ranks == 1:
        return [tree.python]
    return [tree.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]


def run(tree: Tree, argv: Sequence[str], *, ranks: int = 1, marker: str | None = None,
        env: dict[str, str] | None = None, timeout: float = 3600,
        read: Callable[[Path, subprocess.CompletedProcess], dict] | None = None) -> dict:
    """Run `argv` (after the interpreter: `-m moetrain ...` or a script path) in `tree`; its JSON report.

    `{tmp}` in argv is a fresh temporary directory, `{json}` the file {tmp}/report.json. The report is
    `read(tmp, finished process)` if given, else the last stdout line starting with `marker`, else {json}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [*launcher(tree, ranks),
                   *(a.replace("{json}", str(report)).replace("{tmp}", tmp) for a in argv), *tree.args]
        done = subprocess.run(command, cwd=tree.path, env=env or tree.env(), capture_output=True, text=True,
                              timeout=timeout, check=False)
        lines = [x for x in done.stdout.splitlines() if marker and x.startswith(marker)]
        if done.returncode != 0 or (marker and not lines) or not (read or marker or report.is_file()):
            raise RuntimeError(f"{tree.label} ({tree.path}) failed ({done.returncode}): {' '.join(command)}\n"
                               f"{done.stderr[-3000:]}")
        if read:
            return read(Path(tmp), done)
        return json.loads(lines[-1][len(marker):]) if marker else json.loads(report.read_text())


def lookup(report: dict, key: str) -> float:
    """A number in a nested report by its dotted path (`summary.tokens_per_s`)."""
    value = report
    for part in key.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return float(value)


def medians(rows: list[dict], metrics: Sequence[str], by: Sequence[str] = ("case", "label")) -> list[dict]:
    """Per group of rows with equal `by` fields (in first-seen order): run count and each metric's median."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in by), []).append(row)
    return [{**dict(zip(by, key, strict=True)), "runs": len(picked),
             **{m: statistics.median(r[m] for r in picked) for m in metrics},
             **{f"{m}_runs": [r[m] for r in picked] for m in metrics}}
            for key, picked in groups.items()]


def table(summary: list[dict], metrics: Sequence[str], by: Sequence[str] = ("case", "label"),
          baseline: str = "A") -> str:
    """Markdown: one line per group, the medians, and per metric B / A against the same case's baseline."""
    base = {row.get("case"): row for row in summary if row["label"] == baseline}
    head = [*by, "runs", *metrics, *(f"{m} / {baseline}" for m in metrics)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary:
        ref = base.get(row.get("case"))
        ratios = [f"{row[m] / ref[m]:.3f}" if ref and ref[m] else "" for m in metrics]
        lines.append("| " + " | ".join([*(str(row[k]) for k in by), str(row["runs"]),
                                        *(f"{row[m]:.4g}" for m in metrics), *ratios]) + " |")
    return "\n".join(lines)


def plot(summary: list[dict], metric: str, path: Path, title: str = "", baseline: str = "A") -> None:
    """Bars of the medians (baseline grey), one dot per run."""
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(summary)), 4))
    ax.bar(range(len(summary)), [row[metric] for row in summary],
           color=["tab:gray" if row["label"].startswith(baseline) else "tab:blue" for row in summary])
    for i, row in enumerate(summary):
        ax.plot([i] * len(row[f"{metric}_runs"]), row[f"{metric}_runs"], "k.", ms=4)
    ax.set_xticks(range(len(summary)), [f"{row.get('case', '')}\n{row['label']}" for row in summary], fontsize=7)
    ax.set_ylabel(f"{metric} (median, dots: runs)")
    ax.set_title(title or path.stem, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def revision(tree: Tree) -> str:
    """The tree's commit (what a report names instead of a machine's path), "+" if it has uncommitted changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree.path), *args], capture_output=True, text=True,
                              check=False).stdout.strip()
    return (git("rev-parse", "--short", "HEAD") or tree.path.name) + ("+" if git("status", "--porcelain") else "")


def save(out: Path, payload: dict, text: str | None = None) -> None:
    """OUT.json (payload, with the command line and time) and, given, OUT.md."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**payload, "argv": sys.argv, "time": time.time()},
                                                   indent=2) + "\n")
    if text is not None:
        out.with_suffix(".md").write_text(text + "\n")


def compare(trees: dict[str, Tree], argv: Sequence[str], metrics: Sequence[str], *, rounds: int, ranks: int = 1,
            marker: str | None = None, case: str = "") -> list[dict]:
    """Rows of `argv` run in each tree, alternating, each with the metrics picked out of its report."""
    rows = []
    for round_, label in alternate(list(trees), rounds):
        report = run(trees[label], argv, ranks=ranks, marker=marker)
        row = {"case": case, "label": label, "round": round_, "loadavg": os.getloadavg()[0],
               **{m: lookup(report, m) for m in metrics}, "report": report}
        rows.append(row)
        print(f"round {round_} {label}: " + ", ".join(f"{m} {row[m]:.4g}" for m in metrics)
              + f" | load {row['loadavg']:.1f}", flush=True)
    return rows


def main(argv: list[str]) -> None:
    head, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s --baseline DIR [options] -- COMMAND ... {json} ...")
    parser.add_argument("--baseline", required=True, help="tree A: a checkout with src/")
    parser.add_argument("--candidate", default=str(REPO), help="tree B (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=1, help="torchrun over this many local ranks when > 1")
    parser.add_argument("--marker", help="read the report from the last stdout line starting with this")
    parser.add_argument("--metric", action="append", default=[], help="a dotted path of a number in the report")
    parser.add_argument("--python-from-tree", action="store_true", help="each tree's own .venv/bin/python")
    parser.add_argument("--out", type=Path, default=RESULTS / "ab", help="writes OUT.json, OUT.md and OUT.png")
    opts = parser.parse_args(head)
    if not command or not opts.metric:
        parser.error("give at least one --metric and a command after --")
    trees = two_trees(opts.baseline, opts.candidate, python_from_tree=opts.python_from_tree)
    rows = compare(trees, command, opts.metric, rounds=opts.rounds, ranks=opts.ranks, marker=opts.marker)
    summary = medians(rows, opts.metric)
    text = table(summary, opts.metric)
    print(text)
    save(opts.out, {"trees": {k: revision(t) for k, t in trees.items()}, "command": command, "rows": rows,
                    "summary": summary}, text)
    plot(summary, opts.metric[0], opts.out.with_suffix(".png"))


if __name__ == "__main__":
    main(sys.argv[1:])
