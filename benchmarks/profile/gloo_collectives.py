"""CPU-seconds and wall time of FSDP's collectives on gloo, against the same bytes moved by broadcasts and send/recv.

    torchrun --standalone --nproc-per-node 4 benchmarks/profile/gloo_collectives.py [--numel N] [--dtype float32]

Each rank times 3 calls of each way to all-gather and reduce-scatter one buffer (default 37 748 736
elements: one Qwen3-MoE debug layer's expert weights, 151 MB in float32), after one untimed call,
and rank 0 prints per call the wall time and this process's user and system CPU time (getrusage,
all threads, gloo's included). The ways: gloo's `all_gather_into_tensor` / `reduce_scatter_tensor`
(what FSDP2 calls by default), one broadcast per shard / one send+recv per pair and a local sum
(`moetrain.parallel.gloo_comms`), and an all-reduce for scale. Benchmark only: nothing is asserted.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.distributed as dist


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=37_748_736)
    parser.add_argument("--dtype", default="float32")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from moetrain.parallel.gloo_comms import BroadcastAllGather, HostBufferPool, PointToPointReduceScatter

    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    dtype = getattr(torch, ns.dtype)
    shard = torch.randn(ns.numel // world).to(dtype)
    gathered = torch.empty(ns.numel, dtype=dtype)
    full = torch.randn(ns.numel).to(dtype)
    reduced = torch.empty(ns.numel // world, dtype=dtype)
    pool = HostBufferPool()
    ways = {
        "all_gather_into_tensor (gloo)": lambda: dist.all_gather_into_tensor(gathered, shard),
        "broadcast per shard (moetrain)": lambda: BroadcastAllGather(pool)(gathered, shard, group),
        "reduce_scatter_tensor (gloo)": lambda: dist.reduce_scatter_tensor(reduced, full),
        "send/recv + local sum (moetrain)": lambda: PointToPointReduceScatter(pool)(reduced, full, group),
        "all_reduce (gloo, 2x the bytes)": lambda: dist.all_reduce(full),
    }
    if rank == 0:
        print(f"{world} gloo ranks, {ns.numel} {ns.dtype} elements ({ns.numel * dtype.itemsize / 1e6:.0f} MB), "
              "per call: wall s, user CPU-s, system CPU-s (rank 0)")
    for name, call in ways.items():
        call()
        dist.barrier()
        start, (user0, sys0) = time.perf_counter(), _cpu()
        for _ in range(3):
            call()
        dist.barrier()
        wall, (user1, sys1) = time.perf_counter() - start, _cpu()
        if rank == 0:
            print(f"  {name:34s} {wall / 3:7.3f} {(user1 - user0) / 3:7.3f} {(sys1 - sys0) / 3:7.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
