"""Optimizer step time and memory per rank, Muon against AdamW, side by side, on 1 rank, FSDP 4 and EP 4 (gloo).

    PYTHONPATH=src:. .venv/bin/python benchmarks/profile/optimizer_step.py [--repeats 6] [--out FILE.json]

Each layout builds the default job's model (configs/tiny_moe.toml: 4 blocks, 16 experts of width 128),
runs one forward and backward on random tokens so every parameter has a gradient, builds both
optimizers with `build_optimizer` (train.optimizer "adamw" and "muon", Newton–Schulz in bfloat16 as
by default) and then steps them alternately, A B B A ..., `--repeats` times each, after one untimed
step each (state allocation). Per rank and optimizer it reports the median wall time of a step,
the optimizer state it holds (bytes of its local state tensors) and the resident-set high-water
mark's rise over the step (Linux VmHWM reset before each step: the step's transient memory). Each
rank runs one intra-op thread. The ranks share the machine's cores, so on a loaded machine the
4-rank times include waiting for cores; the Muon / AdamW ratio of one run is the number to read.
Benchmark only: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from moetrain.config.job import load
from moetrain.config.parallel import ParallelConfig
from moetrain.config.train import TrainConfig
from moetrain.observe.peak_memory import PeakMemory, current_rss_bytes
from moetrain.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {"1 rank": (1, 1), "FSDP 4": (4, 1), "EP 4 (FSDP 4)": (4, 4)}  # (world, ep)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def _worker(world: int, ep: int, repeats: int) -> dict:
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed
    from moetrain.train.build import build_model
    from moetrain.train.optim import build_optimizer

    torch.set_num_threads(1)
    _, _, device = init_distributed(ParallelConfig())
    job = load(ROOT / "configs" / "tiny_moe.toml")
    parallel = ParallelConfig(dp_shard=world, ep=ep)
    mesh = JobMesh.from_config(parallel, world, device)
    model = build_model(job.model, parallel, mesh, device, weights="init")
    tokens = torch.randint(0, job.model.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    model(tokens).float().pow(2).mean().backward()
    optimizers = {name: build_optimizer(model, TrainConfig(optimizer=name)) for name in ("adamw", "muon")}
    memory = PeakMemory(device)
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    rises: dict[str, list[float]] = {name: [] for name in optimizers}
    for name in optimizers:
        optimizers[name].step()  # untimed: allocates the state
    order = ["adamw", "muon"]
    for index in range(repeats):
        for name in order if index % 2 == 0 else order[::-1]:
            memory.read_and_reset()
            before = current_rss_bytes()
            start = time.perf_counter()
            optimizers[name].step()
            times[name].append(time.perf_counter() - start)
            peak = memory.read_and_reset()["peak_rss"]
            rises[name].append(max(0.0, peak - before))
    return {name: {"step_s_median": statistics.median(times[name]), "state_bytes": _state_bytes(optimizers[name]),
                   "step_rss_rise_bytes_max": max(rises[name])} for name in optimizers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    report = {}
    for label, (world, ep) in LAYOUTS.items():
        per_rank = run_on_ranks(_worker, world, world, ep, args.repeats, timeout=1200)
        report[label] = per_rank
        for name in ("adamw", "muon"):
            times = [r[name]["step_s_median"] for r in per_rank]
            state = [r[name]["state_bytes"] / 2**20 for r in per_rank]
            rise = [r[name]["step_rss_rise_bytes_max"] / 2**20 for r in per_rank]
            print(f"{label:14s} {name:5s} step {max(times) * 1e3:8.1f} ms (slowest rank)  state/rank "
                  f"{max(state):6.2f} MiB  step RSS rise/rank {max(rise):6.2f} MiB", flush=True)
        ratio = max(r["muon"]["step_s_median"] for r in per_rank) / max(r["adamw"]["step_s_median"] for r in per_rank)
        print(f"{label:14s} muon / adamw step time {ratio:.2f}x", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
