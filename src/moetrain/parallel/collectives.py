"""The few collectives the trainer, metrics and checkpoints share, safe without a process group.

Each helper works on any world: with no initialised process group (or a one-rank
one) it does the local equivalent and communicates nothing. Those with a `group`
argument run on that process group (a background thread's own, so its collectives
cannot interleave with the training loop's), by default on the default group.
Tensors travel on the device the group's backend needs (CUDA for NCCL). This module
moves small values between ranks; it must not know about models, optimizers or files.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist


def distributed() -> bool:
    """True when a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) without one."""
    if distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def multi_rank() -> bool:
    """True when a default process group of more than one rank is initialised."""
    return distributed() and dist.get_world_size() > 1


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a collective's tensors must live: the current CUDA device for NCCL, else the CPU."""
    if distributed() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of `group` (default: the default group)."""
    if multi_rank():
        dist.barrier(group=group)


def leave_together(timeout_s: float = 10.0) -> None:
    """The last collective of a process: a barrier that returns once the backend has let go of it.

    A backend's worker thread drops its reference to a finished collective's tensors after
    the caller has already been told the collective is done, and dropping a tensor that
    Python also knows takes the GIL. When that happens after the interpreter has begun to
    shut down, the worker thread is torn down inside C++ code and the process aborts
    ("terminate called without an active exception", SIGABRT), after a run that
    succeeded. So the last collective is an all-reduce of a tensor whose Python
    reference count is watched until the worker has released it (its count is back to
    where it was), sleeping meanwhile so the worker can take the GIL. Earlier
    collectives' workers got the GIL during this one's wait.
    """
    if not multi_rank():
        return
    token = torch.zeros(1, device=collective_device())
    baseline = sys.getrefcount(token)
    dist.all_reduce(token)
    deadline = time.monotonic() + timeout_s
    while sys.getrefcount(token) > baseline and time.monotonic() < deadline:
        time.sleep(0.001)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum `tensor` over the ranks of `group` in place (and return it)."""
    if multi_rank():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_int(value: int, group: dist.ProcessGroup | None = None) -> int:
    """Sum of an integer over the ranks of `group` (one all-reduce)."""
    if not distributed():
        return int(value)
    total = torch.tensor([int(value)], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total.item())


def all_ranks_true(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True when `flag` is true on every rank of `group` (one MIN all-reduce)."""
    if not multi_rank():
        return bool(flag)
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


def all_gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (the same length on every rank), indexed by rank."""
    local = torch.tensor(values, dtype=torch.float64, device=collective_device())
    if not multi_rank():
        return [local.tolist()]
    out = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `obj` (of `group`), indexed by rank (in-memory objects only; nothing read from disk)."""
    if not multi_rank():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank `src`'s integer on every rank."""
    if not multi_rank():
        return int(value)
    tensor = torch.tensor([int(value)], dtype=torch.int64, device=collective_device())
    dist.broadcast(tensor, src=src)
    return int(tensor.item())
