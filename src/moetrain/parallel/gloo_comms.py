"""FSDP2's all-gather and reduce-scatter on gloo, built from broadcasts and point-to-point sends.

On a CPU (gloo) process group FSDP2 calls `all_gather_into_tensor` and `reduce_scatter_tensor`
once per unit gather and gradient reduction. Gloo runs both far slower than the same bytes moved
by its broadcast and send/recv: on 4 ranks of one busy 2-core host, per 151 MB (one Qwen3-MoE debug
layer) call, the all-gather cost 0.13-0.23 CPU-s per rank (mostly kernel time) and 1.0-1.6 s of
wall time, one broadcast per shard 0.05-0.06 CPU-s and 0.3-0.5 s; the reduce-scatter 0.21 CPU-s
against 0.07-0.08 for one send/recv per pair and a local sum (benchmarks/profile/gloo_collectives.py and
its earlier drafts, three runs; docs/design/performance.md, "Several ranks"). The bytes each rank
sends and receives are the same ((world - 1) / world of the buffer); only gloo's handling differs.

`BroadcastAllGather` and `PointToPointReduceScatter` implement FSDP2's custom-comm interfaces
(`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`). The all-gather is exact (each
shard is copied, never combined). The reduce-scatter sums each rank's chunk from every rank in rank
order 0, 1, ..., world - 1 in the reduce dtype: the same sum as gloo's, associated in a fixed order,
so it is deterministic and identical from run to run. Reductions other than SUM (FSDP never asks for
them here: `moetrain.parallel.shard` forces SUM) fall back to gloo's own reduce-scatter.

This module moves FSDP's buffers; it must not change which values are gathered or reduced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class _Works(dist.Work):
    """One Work for several: FSDP waits on the all-gather's single Work before its copy-out."""

    def __init__(self, works: list[dist.Work]):
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 (the signature FSDP calls)
        for work in self._works:
            work.wait()
        return True


class HostBufferPool:
    """Reused communication buffers: a fresh 150 MB buffer costs its page faults and zeroing every time.

    FSDP allocates a unit's all-gather output and reduce-scatter input through the comm at every use
    (60 and 22 buffers of up to 157 MB per Qwen3-MoE debug step) and drops them when done; freshly
    mapped pages cost about 0.04 CPU-s per 150 MB on this machine against 0.01 for a reused buffer.
    `take` hands out a view of a pooled buffer of the same numel and dtype that nothing references
    any more (its storage's only owners are the pool and the check itself), else a new one, pooled
    while fewer than `per_size` of that size exist (2: a gather in flight while the previous one is
    copied out, or a reduction beside the next gather; more would sit idle at the step's peak).
    A buffer is never handed out while FSDP, gloo (an in-flight Work holds its tensors) or autograd
    still holds any view of it.
    """

    def __init__(self, per_size: int = 2):
        self.per_size = per_size
        self._buffers: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffers = self._buffers.setdefault((numel, dtype, device), [])
        for buffer in buffers:
            # 2 = the pooled tensor and the temporary storage object asking.
            if torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) == 2:
                return buffer.view(-1)
        buffer = torch.empty(numel, dtype=dtype, device=device)
        if len(buffers) < self.per_size:
            buffers.append(buffer)
            return buffer.view(-1)
        return buffer


class _PooledAlloc:
    def __init__(self, pool: HostBufferPool | None = None):
        self.pool = pool if pool is not None else HostBufferPool()

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return self.pool.take(math.prod(int(s) for s in size), dtype, device).view(*size)


class BroadcastAllGather(_PooledAlloc, AllGather):
    """All-gather as one broadcast per rank's shard, each from its owner, into the output's slots.

    FSDP's copy-in has already written this rank's shard into its slot of `output_tensor`
    (`input_tensor` is that slot), so the own broadcast sends in place and nothing is copied.
    """

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        world, rank = group.size(), group.rank()
        slots = output_tensor.view(world, -1)
        if input_tensor.data_ptr() != slots[rank].data_ptr():
            slots[rank].copy_(input_tensor)
        works = [dist.broadcast(slots[src], group=group, group_src=src, async_op=True) for src in range(world)]
        work = _Works(works)
        if async_op:
            return work
        work.wait()
        return None


class PointToPointReduceScatter(_PooledAlloc, ReduceScatter):
    """Reduce-scatter (SUM) as one send and one receive per pair of ranks, then a local sum in rank order.

    Rank r sends chunk d of its input to rank d and receives chunk r of every other rank's input
    into a temporary of (world - 1) chunks; its output is chunk r of rank 0 + ... + rank world - 1.
    The input comes from the pool; the output does not, since it becomes the sharded gradient and
    lives until the optimizer step.
    """

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        numel = math.prod(int(s) for s in size)
        # FSDP allocates each reduction's input, then its output, 1/world of it (foreach_reduce). A
        # misjudged size costs memory only: the pool never hands out a buffer still referenced.
        is_output = numel < self._last_input_numel
        self._last_input_numel = 0 if is_output else numel
        if is_output:
            return torch.empty(numel, dtype=dtype, device=device).view(*size)
        return self.pool.take(numel, dtype, device).view(*size)

    _last_input_numel = 0

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False) -> dist.Work | None:
        if op != dist.ReduceOp.SUM:
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        world, rank = group.size(), group.rank()
        chunks = input_tensor.view(world, -1)
        # Not pooled: a pooled receive buffer stayed allocated beside the pooled gathers and raised the
        # peak RSS per rank by 108 MiB (qwen3_moe_debug, FSDP 4, benchmarks/ab/multirank_overhead.py).
        received = torch.empty((world - 1, chunks.shape[1]), dtype=input_tensor.dtype, device=input_tensor.device)
        peers = [peer for peer in range(world) if peer != rank]
        ops = []
        for step in range(1, world):  # a ring of offsets: every rank sends and receives once per step
            dst, src = (rank + step) % world, (rank - step) % world
            ops.append(dist.P2POp(dist.isend, chunks[dst], group=group, group_peer=dst))
            ops.append(dist.P2POp(dist.irecv, received[peers.index(src)], group=group, group_peer=src))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        parts = [chunks[rank] if peer == rank else received[peers.index(peer)] for peer in range(world)]
        output = output_tensor.view(-1)
        output.copy_(parts[0])
        for part in parts[1:]:
            output.add_(part)
        return None


def use_gloo_comms(unit: FSDPModule, pool: HostBufferPool) -> bool:
    """Install both comms on an FSDP unit when the process group is gloo; whether it did.

    Units with several parameter groups (expert weights on their own mesh under EP) keep FSDP's
    default: FSDP refuses one custom comm for several meshes.
    """
    if dist.get_backend() != "gloo" or len(unit._get_fsdp_state()._fsdp_param_groups) != 1:
        return False
    unit.set_custom_all_gather(BroadcastAllGather(pool))
    unit.set_custom_reduce_scatter(PointToPointReduceScatter(pool))
    return True
