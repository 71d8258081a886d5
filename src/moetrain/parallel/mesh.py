"""Process group and device mesh from the parallel config.

`init_distributed` joins (or reuses) the process group: under `torchrun` it reads the
standard environment variables, under the test harness it finds the group already
initialised, and a plain single process gets a private one-rank group backed by an
in-memory store (no port, no network), so every later step runs one code path.
`build_mesh` turns `dp_replicate x dp_shard` into a 2-D DeviceMesh with dims
("dp_replicate", "dp_shard"). This module picks devices and backends; it must not
touch models or gradients.

With expert parallelism (`parallel.ep > 1`) `build_mesh` cuts that mesh from a 3-D root
("dp_replicate", "efsdp", "ep"), dp_shard being "efsdp" and "ep" flattened, so the
data-parallel layout is unchanged, and `expert_meshes` finds the expert-parallel group
(consecutive ranks) and the expert-FSDP mesh (the ranks holding the same experts) on
the same root.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.rendezvous import rendezvous

from moetrain.config.parallel import ParallelConfig, check_world_size
from moetrain.errors import ConfigError

MESH_DIM_NAMES = ("dp_replicate", "dp_shard")
# Expert parallelism splits dp_shard into (efsdp, ep): "ep" ranks own different experts,
# "efsdp" ranks hold the same experts and FSDP-shard them. ep is innermost so an EP group
# is consecutive ranks (one node on GPUs, where the all-to-all is cheapest).
EP_MESH_DIM_NAMES = ("dp_replicate", "efsdp", "ep")
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


def build_mesh(parallel: ParallelConfig, world_size: int, device_type: str) -> DeviceMesh | None:
    """A ("dp_replicate", "dp_shard") mesh for the world, or None when no group exists.

    Raises ConfigError (one line) when the sizes do not multiply to the world size.
    None is only returned for a one-rank world without a process group, where the
    caller then runs the model unsharded.
    """
    replicate, shard = check_world_size(parallel, world_size)
    if not dist.is_initialized():
        if world_size != 1:
            raise ConfigError(f"world size {world_size} needs an initialised process group: "
                              "call moetrain.parallel.mesh.init_distributed first")
        return None
    if dist.get_world_size() != world_size:
        raise ConfigError(f"world size {world_size} does not match the process group's "
                          f"{dist.get_world_size()} ranks")
    if parallel.ep == 1:
        return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=MESH_DIM_NAMES)
    root = init_device_mesh(device_type, (replicate, shard // parallel.ep, parallel.ep),
                            mesh_dim_names=EP_MESH_DIM_NAMES)
    # The same ranks and order as the plain 2-D mesh (rank = r * shard + f * ep + e), so
    # non-expert parameters, the data loader and the sync policies see no difference.
    flat_shard = root["efsdp", "ep"]._flatten("dp_shard")
    return DeviceMesh._concatenate([root["dp_replicate"], flat_shard])


@dataclass(frozen=True)
class ExpertMeshes:
    """The meshes expert parallelism runs on, cut from the data-parallel mesh's root.

    ep: the ranks that split one layer's experts between them (all-to-all group).
    fsdp: the mesh expert weights are FSDP-sharded on: ("efsdp",) or, under HSDP,
    ("dp_replicate", "efsdp"), the replicate dimension replicating experts too.
    """

    ep: DeviceMesh
    fsdp: DeviceMesh

    @property
    def degree(self) -> int:
        return self.ep.size()


def expert_meshes(mesh: DeviceMesh | None) -> ExpertMeshes | None:
    """The EP meshes of a mesh from `build_mesh`, or None when it was built without expert parallelism."""
    if mesh is None:
        return None
    root = mesh._get_root_mesh()
    if root.mesh_dim_names != EP_MESH_DIM_NAMES:
        return None
    fsdp = root["dp_replicate", "efsdp"] if root.size(0) > 1 else root["efsdp"]
    return ExpertMeshes(ep=root["ep"], fsdp=fsdp)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh to hand to fully_shard: 1-D when nothing is replicated, else 2-D (HSDP).

    With dp_replicate = 1 a 2-D mesh would add an all-reduce over a one-rank group to
    every gradient reduction; the 1-D shard mesh is the same layout without it.
    """
    if mesh.size(0) == 1:
        return mesh["dp_shard"]
    return mesh


def mesh_shape(mesh: DeviceMesh | None) -> tuple[int, int]:
    """(dp_replicate, dp_shard) of a mesh; (1, 1) for no mesh."""
    if mesh is None:
        return 1, 1
    return mesh.size(0), mesh.size(1)
