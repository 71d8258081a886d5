"""The process group: joining it, owning it, and leaving it, in one place for every command.

`init_distributed` joins (or reuses) the process group: under `torchrun` it reads the
standard environment variables, under the test harness it finds the group already
initialised, and a plain single process gets a private one-rank group backed by an
in-memory store (no port, no network), so every later step runs one code path.

`owned_process_group()` is the one owner of a group's lifetime: a group that did not exist
when the block began is destroyed when it ends, after the ranks leave together
(`collectives.leave_together`) when the block succeeded; a group someone else made (the test
harness, a caller) is left alone. `distributed_job(parallel)` is what a training command
needs: join the group, lay out the job's mesh once (`moetrain.parallel.mesh.JobMesh`), own
the group. This module picks devices and backends; it must not lay out meshes itself or touch
models or gradients.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from moetrain.config.parallel import ParallelConfig
from moetrain.errors import ConfigError
from moetrain.parallel.collectives import distributed, leave_together
from moetrain.parallel.mesh import JobMesh

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _device_type(parallel: ParallelConfig, backend_in_use: str | None) -> str:
    if parallel.device != "auto":
        return parallel.device
    if backend_in_use is not None:
        # A group someone else initialised decides: gloo groups carry CPU tensors here
        # (the harness is gloo even on a GPU machine), NCCL groups carry CUDA tensors.
        return "cuda" if backend_in_use == "nccl" else "cpu"
    if parallel.backend == "gloo":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _backend_for(device_type: str, parallel: ParallelConfig) -> str:
    if parallel.backend != "auto":
        if parallel.backend == "nccl" and device_type != "cuda":
            raise ConfigError(f"parallel.backend = 'nccl' is invalid with parallel.device = {device_type!r}: "
                              "use gloo on CPU")
        return parallel.backend
    return "nccl" if device_type == "cuda" else "gloo"


def _local_device(device_type: str) -> torch.device:
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("parallel.device = 'cuda' is invalid: no CUDA device is available (use 'cpu')")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(parallel: ParallelConfig) -> tuple[int, int, torch.device]:
    """Join or reuse the default process group; return (rank, world_size, device).

    Order of precedence: an already-initialised group (test harness, caller; its own
    timeout stays), the torchrun environment (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT,
    multi-node too), else a private single-rank group on an in-memory store. A group
    made here times out collectives after `parallel.collective_timeout_s`.
    """
    if dist.is_initialized():
        device_type = _device_type(parallel, dist.get_backend())
        return dist.get_rank(), dist.get_world_size(), _local_device(device_type)
    device_type = _device_type(parallel, None)
    backend = _backend_for(device_type, parallel)
    device = _local_device(device_type)
    # Every collective on this group (and the groups the mesh cuts from it) gives up after
    # this long: a hung peer then ends the run with an error instead of a 30-minute wait.
    timeout = timedelta(seconds=parallel.collective_timeout_s)
    if all(var in os.environ for var in _TORCHRUN_VARS):
        init_kwargs = {"device_id": device} if device.type == "cuda" else {}
        # torchrun keeps one store for all restarts of a job (`--max-restarts`) and does not
        # prefix it per attempt, so a restarted rank could read a dead peer's address left by
        # the previous attempt and fail to connect. One key prefix per attempt avoids that.
        store, rank, world = next(rendezvous("env://"))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"moetrain.attempt_{attempt}", store), rank=rank,
                                world_size=world, timeout=timeout, **init_kwargs)
    else:
        # One rank, no launcher: a HashStore needs no port, so tests and laptops never
        # collide on MASTER_PORT, and FSDP still gets the group it requires.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


@contextmanager
def owned_process_group() -> Iterator[None]:
    """Destroy, at the end of the block, a process group that did not exist when it began.

    Also when the block fails (a mesh that does not fit the world, a rank's error). Only
    when it succeeds do the ranks first leave together: otherwise gloo's worker threads can
    still hold the last collective when the interpreter exits, and a rank aborts (SIGABRT)
    after a run that succeeded.
    """
    owned = not distributed()
    try:
        yield
        if owned and distributed():
            leave_together()
    finally:
        if owned and distributed():
            dist.destroy_process_group()


@contextmanager
def distributed_job(parallel: ParallelConfig) -> Iterator[JobMesh]:
    """Join (or create) the process group, lay out the job's mesh per `parallel`, and own the group."""
    with owned_process_group():
        _, world, device = init_distributed(parallel)
        yield JobMesh.from_config(parallel, world, device)
