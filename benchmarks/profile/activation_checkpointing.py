"""Activation checkpointing modes side by side: forward+backward time and peak memory per mode.

    PYTHONPATH=src .venv/bin/python benchmarks/profile/activation_checkpointing.py \
        [--config configs/qwen3_moe_debug.toml] [--repeats 2] [--steps 2] \
        [--json benchmarks/results/activation_checkpointing.json] [--section.field value ...]

Each measurement is a fresh process (the RSS high-water mark is per process) that builds the
config's model exactly as training does (`train.build.build_model`, with the mode under test),
runs one warm-up and `--steps` timed forward+backward passes of one microbatch (random tokens, two
documents per row) and reports the median pass time and the peak RSS above the RSS before the
first pass (what the passes themselves allocate: activations, the SAC cache, gradients), and the
pass's process CPU time (one thread: on a shared machine less disturbed than wall time). Modes
run interleaved, the order reversed on every other repeat, so on a shared machine their ratios
are measured side by side; absolute times are not comparable across runs.
The remaining arguments are config overrides (e.g. `--model.n_layers 4`).
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moetrain.args import take_option
from moetrain.config.job import parse_job_args
from moetrain.train.build import build_model

MODES = [("none", 1), ("selective", 1), ("full", 1), ("full", 2), ("selective", 2)]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(argv: list[str], mode: str, every: int, steps: int) -> dict:
    cfg = parse_job_args(argv)
    torch.set_num_threads(max(cfg.train.num_threads, 1))
    model = build_model(cfg.model, seed=0, activation_checkpointing=mode, activation_checkpointing_every=every)
    model.train()
    rows, seq = cfg.train.microbatch_size, cfg.data.seq_len
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, seq), generator=g)
    docs = (torch.arange(seq) >= seq // 3).long().expand(rows, seq)
    base = rss_bytes()
    times, cpu_times = [], []
    for step in range(1 + steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        logits = model(tokens, document_ids=docs)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        (loss + model.aux_loss()).backward()
        if step:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        model.zero_grad(set_to_none=False)  # keep the gradient buffers: the peak counts them once
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": mode, "every": every, "step_s": statistics.median(times),
            "step_cpu_s": statistics.median(cpu_times), "peak_rss_above_base": peak - base,
            "loss": float(loss)}


def main(argv: list[str]) -> None:
    json_path, argv = take_option(argv, "json")
    repeats, argv = take_option(argv, "repeats")
    steps, argv = take_option(argv, "steps")
    repeats, steps = int(repeats or 2), int(steps or 2)
    runs = []
    for repeat in range(repeats):
        for mode, every in (MODES if repeat % 2 == 0 else MODES[::-1]):
            out = subprocess.run([sys.executable, __file__, "--child", f"{mode}:{every}:{steps}", *argv],
                                 check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]) | {"repeat": repeat})
            print(runs[-1], flush=True)
    summary = []
    base = {}
    for mode, every in MODES:
        mine = [r for r in runs if (r["mode"], r["every"]) == (mode, every)]
        row = {"mode": mode, "every": every, "step_s_median": statistics.median(r["step_s"] for r in mine),
               "step_cpu_s_median": statistics.median(r["step_cpu_s"] for r in mine),
               "peak_rss_above_base_mib": statistics.median(r["peak_rss_above_base"] for r in mine) / 2**20,
               "losses": sorted({r["loss"] for r in mine})}
        base = base or row
        row["time_vs_none"] = row["step_s_median"] / base["step_s_median"]
        row["cpu_time_vs_none"] = row["step_cpu_s_median"] / base["step_cpu_s_median"]
        row["memory_vs_none"] = row["peak_rss_above_base_mib"] / base["peak_rss_above_base_mib"]
        summary.append(row)
    lines = ["| mode | every | fwd+bwd CPU s | x none | wall s | x none | peak RSS above base MiB | x none |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['every']} | {r['step_cpu_s_median']:.2f} | {r['cpu_time_vs_none']:.2f} | "
              f"{r['step_s_median']:.2f} | {r['time_vs_none']:.2f} | "
              f"{r['peak_rss_above_base_mib']:.0f} | {r['memory_vs_none']:.2f} |" for r in summary]
    print("\n".join(lines))
    if json_path:
        Path(json_path).write_text(json.dumps({"argv": argv, "repeats": repeats, "steps": steps, "runs": runs,
                                               "summary": summary}, indent=1))
        Path(json_path).with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--child"]:
        mode, every, steps = args[1].split(":")
        print(json.dumps(child(args[2:], mode, int(every), int(steps))))
    else:
        main(args)
