"""The job's device mesh: every parallel dimension named once, and the sub-mesh each consumer needs.

`MeshDims` holds the degrees of the six dimensions a job can split its ranks over, and
`JobMesh.build` lays them out once per job as one root DeviceMesh, outermost first:

    pp  >  dp_replicate  >  dp_shard (= efsdp x ep)  >  cp  >  tp

so that a rank is ((((p * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t), the innermost
dimensions taking consecutive ranks (one node on GPUs, where their traffic is heaviest). Each
consumer then takes its sub-mesh from the JobMesh instead of slicing the root itself:

- `data` ("dp_replicate", "dp_shard"): the ranks that read different batches: the data
  loader's rank and world, the sync policy (replicated or not), token counts.
- `fsdp`: what non-expert parameters are `fully_shard`ed on: the 1-D "dp_shard" mesh when
  nothing is replicated (a 2-D mesh would add an all-reduce over one-rank groups to every
  gradient reduction), else the 2-D data mesh (HSDP).
- `experts` (`ExpertMeshes`, None without expert parallelism): EP borrows its ranks from
  dp_shard, innermost: the root then has ("efsdp", "ep") where a plain job has "dp_shard", an
  EP group is `ep` consecutive ranks, and the data mesh is "dp_replicate" with efsdp x ep
  flattened back into "dp_shard", so the data-parallel layout is the same with and without EP.
- `pipeline`, `context`, `tensor` ("pp", "cp", "tp"): the 1-D sub-meshes of those dimensions,
  None while their degree is 1 (the root then has no such dimension, so the meshes and groups
  of a job without them are unchanged).

A one-rank world without a process group gets a JobMesh without a root (every sub-mesh None):
the model then runs unsharded. This module lays out ranks; it must not create or destroy the
process group (`moetrain.parallel.process_group` does) nor touch models or gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moetrain.config.parallel import ParallelConfig, check_world_size
from moetrain.errors import ConfigError

DATA_DIM_NAMES = ("dp_replicate", "dp_shard")
EXPERT_DIM_NAMES = ("efsdp", "ep")  # dp_shard split in two: ranks holding the same experts x ranks splitting them


@dataclass(frozen=True, kw_only=True)
class MeshDims:
    """The degree of every parallel dimension; their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # not a factor of the world: carved out of dp_shard

    def __post_init__(self) -> None:
        for dim in fields(self):
            if getattr(self, dim.name) < 1:
                raise ConfigError(f"mesh degree {dim.name} = {getattr(self, dim.name)} is invalid: must be >= 1")
        if self.dp_shard % self.ep:
            raise ConfigError(f"mesh degree ep = {self.ep} is invalid: must divide dp_shard = {self.dp_shard}")

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> MeshDims:
        """The degrees `parallel` asks for on `world_size` ranks; ConfigError (one line) when they do not fit."""
        replicate, shard = check_world_size(parallel, world_size)
        return cls(pp=parallel.pp, dp_replicate=replicate, dp_shard=shard, cp=parallel.cp, tp=parallel.tp,
                   ep=parallel.ep)

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    def root_layout(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the root mesh's dimensions, outermost first.

        dp_replicate and the shard dimensions are always there (a plain job's mesh is 2-D);
        pp, cp and tp only when used, so the meshes and groups of today's jobs stay as they are.
        """
        efsdp, ep = EXPERT_DIM_NAMES
        shard = [("dp_shard", self.dp_shard)] if self.ep == 1 else [(efsdp, self.dp_shard // self.ep), (ep, self.ep)]
        layout = [("pp", self.pp), ("dp_replicate", self.dp_replicate), *shard, ("cp", self.cp), ("tp", self.tp)]
        return tuple((name, size) for name, size in layout if size > 1 or name not in ("pp", "cp", "tp"))


@dataclass(frozen=True)
class ExpertMeshes:
    """The meshes expert parallelism runs on, cut from the job's root mesh.

    ep: the ranks that split one layer's experts between them (all-to-all group).
    fsdp: the mesh expert weights are FSDP-sharded on: ("efsdp",) or, under HSDP,
    ("dp_replicate", "efsdp"), the replicate dimension replicating experts too.
    """

    ep: DeviceMesh
    fsdp: DeviceMesh

    @property
    def degree(self) -> int:
        return self.ep.size()


@dataclass(frozen=True)
class JobMesh:
    """A job's ranks laid out over its dimensions, with each consumer's sub-mesh; made by `JobMesh.build`."""

    dims: MeshDims
    rank: int
    device: torch.device
    root: DeviceMesh | None = None
    data: DeviceMesh | None = None
    fsdp: DeviceMesh | None = None
    experts: ExpertMeshes | None = None
    pipeline: DeviceMesh | None = None
    context: DeviceMesh | None = None
    tensor: DeviceMesh | None = None

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int, device: torch.device | str) -> JobMesh:
        """The mesh `parallel` asks for on `world_size` ranks (collective; ConfigError when the degrees do not fit)."""
        return cls.build(MeshDims.from_config(parallel, world_size), device)

    @classmethod
    def build(cls, dims: MeshDims, device: torch.device | str) -> JobMesh:
        """The mesh of `dims` over the process group's ranks, on `device` (collective: every rank calls it).

        Without a process group only a one-rank world is possible, and it gets no root.
        """
        device = torch.device(device)
        if not dist.is_initialized():
            if dims.world != 1:
                raise ConfigError(f"world size {dims.world} needs an initialised process group: "
                                  "call moetrain.parallel.process_group.init_distributed first")
            return cls(dims, 0, device)
        if dist.get_world_size() != dims.world:
            raise ConfigError(f"world size {dims.world} does not match the process group's "
                              f"{dist.get_world_size()} ranks")
        layout = dims.root_layout()
        root = init_device_mesh(device.type, tuple(size for _, size in layout),
                                mesh_dim_names=tuple(name for name, _ in layout))
        names = {name for name, _ in layout}
        experts = None
        if dims.ep == 1:
            data = root[DATA_DIM_NAMES]
        else:
            # The same ranks and order as without EP (s = efsdp * ep + e), so non-expert parameters,
            # the data loader and the sync policies see no difference.
            data = DeviceMesh._concatenate([root["dp_replicate"], root[EXPERT_DIM_NAMES]._flatten("dp_shard")])
            efsdp, ep = EXPERT_DIM_NAMES
            replicated = dims.dp_replicate > 1  # expert weights are replicated like the rest
            experts = ExpertMeshes(ep=root[ep], fsdp=root["dp_replicate", efsdp] if replicated else root[efsdp])
        return cls(dims, dist.get_rank(), device, root, data=data,
                   fsdp=data if dims.dp_replicate > 1 else data["dp_shard"], experts=experts,
                   pipeline=root["pp"] if "pp" in names else None, context=root["cp"] if "cp" in names else None,
                   tensor=root["tp"] if "tp" in names else None)

    @property
    def world(self) -> int:
        return self.dims.world

    @property
    def data_rank(self) -> int:
        """This rank's place among the ranks that read different batches (0 without a root)."""
        return 0 if self.data is None else self.data.mesh.flatten().tolist().index(self.rank)

    @property
    def data_world(self) -> int:
        """How many ranks read different batches."""
        return self.dims.dp_replicate * self.dims.dp_shard

    def describe(self) -> str:
        """The data mesh's shape for a log line, "none" without a root."""
        return "none" if self.data is None else str(tuple(self.data.shape))
