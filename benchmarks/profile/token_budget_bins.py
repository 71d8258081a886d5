"""How full token-budget bins are on a job's training data (no timing: the numbers are deterministic).

`python benchmarks/profile/token_budget_bins.py [--config configs/tiny_moe.toml] [--budgets 128 256 512]
[--json benchmarks/results/token_budget_bins.json]`: for each budget, the number of bins and
pieces, the mean fill (tokens / (bins x budget)) and the share of documents cut into pieces.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from moetrain.config.job import load
from moetrain.data.batching import TokenBudgetBatching, documents_end
from moetrain.data.dataset import load_training_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_moe.toml")
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cfg = load(args.config)
    train = load_training_data(cfg).train
    starts = train.document_starts
    lengths = np.diff(np.append(starts, documents_end(train.stream, train.pad_id)))
    report = {"config": args.config, "seed": cfg.train.seed, "documents": int(starts.size),
              "tokens": int(lengths.sum()), "median_document_tokens": float(np.median(lengths)), "budgets": []}
    print(f"{report['documents']} documents, {report['tokens']} tokens, median {report['median_document_tokens']:.0f}")
    print(f"{'budget':>7} {'bins':>7} {'pieces':>7} {'fill':>6} {'cut docs':>9}")
    for budget in args.budgets:
        layout = TokenBudgetBatching(train, budget, seed=cfg.train.seed).layout
        row = {"budget": budget, "bins": len(layout), "pieces": int(layout.piece_lengths.size),
               "fill": float(layout.bin_tokens().sum() / (len(layout) * budget)),
               "cut_documents": float((lengths > budget).mean())}
        report["budgets"].append(row)
        print(f"{budget:>7} {row['bins']:>7} {row['pieces']:>7} {row['fill']:>6.3f} {row['cut_documents']:>9.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
