"""CPU step time of float8 training (train.float8) against bf16, measured side by side in one process.

Three models of the default job's architecture (configs/tiny_moe.toml) with bf16 compute copies of
float32 master weights: plain bf16, float8 rowwise and float8 tensorwise (torchao's emulation on CPU,
moetrain.parallel.float8.NATIVE_ON). Each round runs one forward+backward+AdamW step of each, in turn,
on the same batch, so a busy machine slows all three alike; the medians and their ratios to bf16 are
printed and written as JSON. A report, not a target: float8 is for GPUs; on CPU it only checks numerics.

    PYTHONPATH=src:. .venv/bin/python benchmarks/ab/float8_step_time.py --rounds 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moetrain.config.job import load
from moetrain.parallel.precision import compute_copy
from moetrain.train.build import build_model

ROOT = Path(__file__).resolve().parents[2]
SIDES = ("none", "rowwise", "tensorwise")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load(ROOT / "configs" / "tiny_moe.toml")
    cfg.parallel.param_dtype = "bfloat16"
    tokens = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    sides = {}
    for recipe in SIDES:
        model = build_model(cfg.model, cfg.parallel, seed=0, float8=recipe).train()
        sides[recipe] = (model, compute_copy(model, cfg.parallel), torch.optim.AdamW(model.parameters(), lr=1e-3))
    times: dict[str, list[float]] = {recipe: [] for recipe in SIDES}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for recipe, (model, copies, optimizer) in sides.items():
            start = time.perf_counter()
            with copies.compute():
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
                (loss + model.aux_loss()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if round_index:
                times[recipe].append(time.perf_counter() - start)
    medians = {recipe: statistics.median(t) for recipe, t in times.items()}
    result = {"tokens_per_step": args.batch * args.seq_len, "threads": args.threads, "rounds": args.rounds,
              "median_step_s": medians, "ratio_to_bf16": {r: medians[r] / medians["none"] for r in SIDES}}
    for recipe in SIDES:
        print(f"{'bf16' if recipe == 'none' else 'float8 ' + recipe:18s} median step {medians[recipe]:.3f} s  "
              f"({result['ratio_to_bf16'][recipe]:.2f}x bf16)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
