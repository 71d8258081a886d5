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
  gradient reduction), else the 2-D data mesh (HSDP). Under context parallelism the "cp" ranks
  join the shard dimension ("dp_shard_cp", as torchtitan folds them): each CP rank computes
  gradients from its own part of every sequence, so FSDP's reduce-scatter must sum over them too,
  and sharding over them divides the parameters' memory further.
- `experts` (`ExpertMeshes`, None without expert or tensor parallelism): EP borrows its ranks from
  dp_shard, innermost: the root then has ("efsdp", "ep") where a plain job has "dp_shard", an
  EP group is `ep` consecutive ranks, and the data mesh is "dp_replicate" with efsdp x ep
  flattened back into "dp_shard", so the data-parallel layout is the same with and without EP.
  EP never borrows from "tp" (torchtitan's choice when it has no expert tensor parallelism):
  here each TP rank routes its own slice of the sequence through its own EP group, and the
  routed experts, which TP does not split, are FSDP-sharded over efsdp x cp x tp
  (`ExpertMeshes.fsdp`), the ranks whose tokens differ while their experts are the same.
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
    """The meshes the routed experts run on, cut from the job's root mesh.

    ep: the ranks that split one layer's experts between them (all-to-all group); None without EP.
    fsdp: the mesh expert weights are FSDP-sharded on: ("efsdp",) or, under HSDP,
    ("dp_replicate", "efsdp"), the replicate dimension replicating experts too; "cp" and "tp"
    flattened into the shard dimension when used (their ranks route different tokens).
    """

    ep: DeviceMesh | None
    fsdp: DeviceMesh

    @property
    def degree(self) -> int:
        return 1 if self.ep is None else self.ep.size()


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
        efsdp, ep = EXPERT_DIM_NAMES
        if dims.ep == 1:
            data = root[DATA_DIM_NAMES]
            shard_dims, expert_shard_dims = ["dp_shard"], ["dp_shard"]
        else:
            # The same ranks and order as without EP (s = efsdp * ep + e), so non-expert parameters,
            # the data loader and the sync policies see no difference.
            data = DeviceMesh._concatenate([root["dp_replicate"], root[EXPERT_DIM_NAMES]._flatten("dp_shard")])
            shard_dims, expert_shard_dims = [efsdp, ep], [efsdp]
        cp = ["cp"] if "cp" in names else []
        tp = ["tp"] if "tp" in names else []
        if cp:
            fsdp = _with_replicate(root, _flat(root, shard_dims + cp, "dp_shard_cp"), dims)
        else:
            fsdp = data if dims.dp_replicate > 1 else data["dp_shard"]
        experts = None
        if dims.ep > 1 or tp:
            expert_fsdp = _flat(root, expert_shard_dims + cp + tp, "_".join(expert_shard_dims + cp + tp))
            experts = ExpertMeshes(ep=root[ep] if dims.ep > 1 else None,
                                   fsdp=_with_replicate(root, expert_fsdp, dims))  # replicas hold experts too
        return cls(dims, dist.get_rank(), device, root, data=data, fsdp=fsdp, experts=experts,
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

    @property
    def sequence_split(self) -> int:
        """Ranks that hold the same microbatches and split each sequence between them (cp x tp)."""
        return self.dims.cp * self.dims.tp

    def describe(self) -> str:
        """The data mesh's shape for a log line, "none" without a root."""
        return "none" if self.data is None else str(tuple(self.data.shape))


def _flat(root: DeviceMesh, names: list[str], flat_name: str) -> DeviceMesh:
    """The 1-D mesh over the root's dimensions `names` (one of them as it is, several flattened)."""
    return root[names[0]] if len(names) == 1 else root[tuple(names)]._flatten(flat_name)


def _with_replicate(root: DeviceMesh, shard: DeviceMesh, dims: MeshDims) -> DeviceMesh:
    """`shard` as FSDP's mesh: 1-D without replicas (no all-reduce over one-rank groups), else HSDP's 2-D."""
    return shard if dims.dp_replicate == 1 else DeviceMesh._concatenate([root["dp_replicate"], shard])
