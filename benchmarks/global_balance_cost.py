"""What the global-batch balance loss costs per step: the no-grad routing pre-pass against the whole step.

    flock /tmp/moetrain-heavy.lock .venv/bin/python benchmarks/global_balance_cost.py \
        --config configs/qwen3_moe_debug.toml --pairs 5 [--section.field value ...]

One Trainer (one process, the configured model and data); its steps alternate between
`aux_loss_scope = "microbatch"` and "global_batch" (the same MoE config object drives both the
layers and the trainer, so flipping it switches the scope), and after every global step the
pre-pass alone is timed again on the same microbatches. Reported: median step time of each
scope, their ratio, and the median pre-pass time as a fraction of the per-microbatch step, all
measured side by side in one run. Writes a JSON next to the printed table.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from moetrain.args import take_option
from moetrain.config import apply_overrides, load
from moetrain.data.dataset import load_training_data
from moetrain.parallel.mesh import build_mesh, init_distributed
from moetrain.train.global_balance import prepare_global_balance
from moetrain.train.trainer import Trainer


def main() -> int:
    config, rest = take_option(sys.argv[1:], "config")
    pairs, rest = take_option(rest, "pairs")  # (microbatch, global) step pairs after one warm-up pair
    json_path, overrides = take_option(rest, "json")
    config = config or "configs/qwen3_moe_debug.toml"
    n_pairs = int(pairs or 5)
    json_path = json_path or "benchmarks/results/global_balance_cost.json"
    cfg = apply_overrides(load(config), [*overrides, "--data.max_documents", "200", "--train.eval_every", "0"])
    torch.set_num_threads(max(cfg.train.num_threads, 1))
    _, world, device = init_distributed(cfg.parallel)
    trainer = Trainer(cfg, load_training_data(cfg), build_mesh(cfg.parallel, world, device.type), device)
    moe_cfg = cfg.model.moe
    times: dict[str, list[float]] = {"microbatch": [], "global_batch": [], "pre_pass": []}
    for pair in range(n_pairs + 1):
        for scope in ("microbatch", "global_batch"):
            moe_cfg.aux_loss_scope = scope
            result = trainer.train_step()
            if pair:
                times[scope].append(result.step_s)
        microbatches = [trainer.loader.next_batch(cfg.train.microbatch_size).to(device)
                        for _ in range(cfg.train.grad_accum)]
        start = time.perf_counter()
        prepare_global_balance(trainer.model, microbatches)
        if pair:
            times["pre_pass"].append(time.perf_counter() - start)
        print(f"pair {pair}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items() if v and pair), flush=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "config": config, "overrides": overrides, "pairs": n_pairs, "threads": torch.get_num_threads(),
        "microbatch_size": cfg.train.microbatch_size, "grad_accum": cfg.train.grad_accum, "seq_len": cfg.data.seq_len,
        "times_s": times, "median_s": median,
        "global_over_microbatch_step": median["global_batch"] / median["microbatch"],
        "pre_pass_over_microbatch_step": median["pre_pass"] / median["microbatch"],
    }
    print(f"{'scope':<14} {'median step s':>14}\n{'microbatch':<14} {median['microbatch']:>14.3f}\n"
          f"{'global_batch':<14} {median['global_batch']:>14.3f}\n"
          f"global / microbatch step time: {report['global_over_microbatch_step']:.3f}; "
          f"pre-pass / microbatch step: {report['pre_pass_over_microbatch_step']:.3f}")
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
