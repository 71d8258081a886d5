"""What the global-batch balance loss costs per step: the no-grad routing pre-pass against the whole step.

    .venv/bin/python benchmarks/profile/global_balance_cost.py \
        --config configs/qwen3_moe_debug.toml --pairs 5 [--section.field value ...]

One Trainer (one process, the configured model and data); its steps alternate between
`aux_loss_scope = "microbatch"` and "global_batch" (the same MoE config object drives both the
layers and the trainer, so flipping it switches the scope), and after every global step the
pre-pass alone is timed again on fresh microbatches. Reported: median step time of each scope,
their ratio, and the median pre-pass time as a fraction of the per-microbatch step, all measured
side by side in one run, in wall time and in this process's CPU time (one thread: on a shared,
oversubscribed machine the CPU time is the steadier measure of the work). Writes a JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from moetrain.args import take_option
from moetrain.config.job import apply_overrides, load
from moetrain.data.dataset import load_training_data
from moetrain.parallel.mesh import JobMesh
from moetrain.parallel.process_group import init_distributed
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
    trainer = Trainer(cfg, load_training_data(cfg), JobMesh.from_config(cfg.parallel, world, device))
    moe_cfg = cfg.model.moe
    names = ("microbatch", "global_batch", "pre_pass")
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}

    def timed(name: str, work, keep: bool) -> None:
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        work()
        if keep:
            wall[name].append(time.perf_counter() - start_wall)
            cpu[name].append(time.process_time() - start_cpu)

    for pair in range(n_pairs + 1):
        for scope in ("microbatch", "global_batch"):
            moe_cfg.aux_loss_scope = scope
            timed(scope, trainer.train_step, keep=pair > 0)
        moe_cfg.aux_loss_scope = "global_batch"
        microbatches = [batch.to(device) for batch in trainer.loader.next_microbatches()]
        timed("pre_pass", lambda mbs=microbatches: prepare_global_balance(trainer.model, mbs), keep=pair > 0)
        if pair:
            print(f"pair {pair}: " + ", ".join(f"{k} {wall[k][-1]:.2f}s wall / {cpu[k][-1]:.2f}s cpu" for k in names),
                  flush=True)
    median = {k: statistics.median(v) for k, v in wall.items()}
    median_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    report = {
        "config": config, "overrides": overrides, "pairs": n_pairs, "threads": torch.get_num_threads(),
        "microbatch_size": cfg.train.microbatch_size, "grad_accum": cfg.train.grad_accum, "seq_len": cfg.data.seq_len,
        "wall_s": wall, "cpu_s": cpu, "median_wall_s": median, "median_cpu_s": median_cpu,
        "global_over_microbatch_step_wall": median["global_batch"] / median["microbatch"],
        "pre_pass_over_microbatch_step_wall": median["pre_pass"] / median["microbatch"],
        "global_over_microbatch_step_cpu": median_cpu["global_batch"] / median_cpu["microbatch"],
        "pre_pass_over_microbatch_step_cpu": median_cpu["pre_pass"] / median_cpu["microbatch"],
    }
    print(f"{'median':<14} {'wall s':>8} {'cpu s':>8}")
    for name in names:
        print(f"{name:<14} {median[name]:>8.3f} {median_cpu[name]:>8.3f}")
    print(f"global / microbatch step: wall {report['global_over_microbatch_step_wall']:.3f}, "
          f"cpu {report['global_over_microbatch_step_cpu']:.3f}; pre-pass / microbatch step: wall "
          f"{report['pre_pass_over_microbatch_step_wall']:.3f}, cpu {report['pre_pass_over_microbatch_step_cpu']:.3f}")
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
