"""Is a multi-rank run memory-flat? RSS per rank and step over a long run, and its slope after warm-up.

    .venv/bin/python benchmarks/stress/memory_flat.py \
        [--config configs/qwen3_moe_debug.toml] [--world 4] [--steps 200] [--warmup 50] \
        [--json benchmarks/results/memory_flat.json] [--section.field value ...]

Trains the config on `--world` spawned gloo ranks (FSDP over all of them unless the overrides
say otherwise) with a record every step, no evaluation, checkpoints or sample, then reads every
rank's end-of-step RSS and per-step peak RSS from the records and reports, per rank: the
least-squares slope of RSS after warm-up (bytes per step), the slope in consecutive windows
(to see whether a drift settles or keeps going) and the RSS at warm-up and at the end, as JSON
and as a table beside it (same name, .txt). The
remaining arguments are config overrides: on a 2-core machine the full qwen3_moe_debug
(8 layers, 2 x 512 tokens) takes minutes per step on 4 ranks, so shorter rows and fewer
layers keep its shapes per layer (dim 256, 16/8 heads of width 128, 64 experts top-8 of width
768) in a run that ends.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from moetrain.args import take_option
from moetrain.config.job import parse_job_args
from moetrain.observe.peak_memory import growth_per_step
from moetrain.runtime.allocator import rank_environment
from moetrain.testing import run_on_ranks
from moetrain.train.run import run

WINDOW = 25  # steps per slope window


def train(argv: list[str]) -> None:
    run(parse_job_args(argv))


def main() -> int:
    config, rest = take_option(sys.argv[1:], "config")
    world, rest = take_option(rest, "world")
    steps, rest = take_option(rest, "steps")
    warmup, rest = take_option(rest, "warmup")
    json_path, overrides = take_option(rest, "json")
    config = config or "configs/qwen3_moe_debug.toml"
    world, steps, warmup = int(world or 4), int(steps or 200), int(warmup or 50)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        argv = ["--config", config, *overrides, "--train.steps", str(steps), "--train.eval_every", "0",
                "--train.sample_tokens", "0", "--checkpoint.enabled", "False", "--logging.log_every", "1",
                "--logging.progress_bar", "False", "--logging.run_dir", str(run_dir)]
        parse_job_args(argv)  # a bad config fails here, in one line, before any rank starts
        start = time.perf_counter()
        run_on_ranks(train, world, argv, timeout=6 * 3600, rank_env=rank_environment(world))  # as under torchrun
        wall_s = time.perf_counter() - start
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    step_s = sorted(r["step_s"] for r in train_records)[len(train_records) // 2]
    ranks = []
    for rank in range(world):
        after = [(r["step"], r["rss_bytes_per_rank"][rank]) for r in train_records if r["step"] > warmup]
        windows = []
        for lo in range(0, steps, WINDOW):
            part = [(r["step"], r["rss_bytes_per_rank"][rank]) for r in train_records if lo < r["step"] <= lo + WINDOW]
            windows.append({"steps": f"{lo + 1}-{lo + WINDOW}",
                            "slope_bytes_per_step": growth_per_step(*map(list, zip(*part)))})
        rss = {r["step"]: r["rss_bytes_per_rank"][rank] for r in train_records}
        ranks.append({
            "rank": rank,
            "slope_after_warmup_bytes_per_step": growth_per_step(*map(list, zip(*after))),
            "rss_at_warmup_bytes": rss[warmup], "rss_at_end_bytes": rss[steps],
            "max_peak_rss_bytes": max(r["peak_rss_bytes_per_rank"][rank] for r in train_records),
            "windows": windows,
        })
    result = {"config": config, "overrides": overrides, "world": world, "steps": steps, "warmup": warmup,
              "median_step_s": step_s, "wall_s": wall_s, "ranks": ranks}
    lines = [f"{config} {' '.join(overrides)}: {world} ranks, {steps} steps, median step {step_s:.2f} s",
             f"{'rank':>4} {'RSS@warmup MiB':>15} {'RSS@end MiB':>12} {'peak MiB':>9} {'slope KiB/step':>15}  "
             f"windows of {WINDOW} steps (KiB/step)"]
    for r in ranks:
        window_text = " ".join(f"{w['slope_bytes_per_step'] / 1024:.0f}" for w in r["windows"])
        lines.append(f"{r['rank']:>4} {r['rss_at_warmup_bytes'] / 2**20:>15.1f} {r['rss_at_end_bytes'] / 2**20:>12.1f} "
                     f"{r['max_peak_rss_bytes'] / 2**20:>9.1f} {r['slope_after_warmup_bytes_per_step'] / 1024:>15.1f}  "
                     f"{window_text}")
    print("\n".join(lines))
    path = Path(json_path or "benchmarks/results/memory_flat.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    path.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
