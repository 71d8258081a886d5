"""Muon (orthogonalized momentum) on hidden matrices, torch's AdamW on every other parameter, under any sharding.

`Muon` is a `torch.optim.AdamW` whose param groups marked `"muon": True` take Muon's update
instead (`moetrain.train.optim.build_optimizer` decides which). Per matrix it is
`torch.optim.Muon`'s update with Moonlight's RMS matching (`adjust_lr_fn="match_rms_adamw"`,
the learning rate times 0.2·sqrt(max(A, B)), torch's own `_adjust_lr`), so AdamW's learning
rate and weight decay carry over:

    buf ← μ·buf + (1 − μ)·g;  u ← (1 − μ)·g + μ·buf (Nesterov) or buf;  O ← NS₅(u)
    W ← W·(1 − lr·λ) − lr·0.2·sqrt(max(A, B))·O

NS is torch's quintic Newton–Schulz iteration (`orthogonalize`). torch's own function always
computes in bfloat16; ours takes the dtype as an argument (`train.muon_ns_dtype`, bfloat16 by
default) and is otherwise the same operations, bit for bit (tests/unit/test_muon.py), because a
float32 or float64 iteration is what lets a sharded run be checked against one process.

Which matrices: a 2-D weight is one matrix; a stacked expert weight [E, A, B] is E matrices, and a
gated expert's fused gate | up weight [E, d, 2n] is 2E matrices [d, n] (the gate and the up
projection are separate linear maps, as a model with separate gate_proj / up_proj has them).

Distributed (docs/design/optimizers.md): momentum stays sharded like the parameter and is updated
locally. Matrices of the same shape and layout are stacked into one [n, A, B] DTensor whose
placements are the parameter's, shifted one dimension right; redistributing it to Shard(0) on every
mesh dimension that holds pieces of the matrices (the FSDP dimension, the HSDP replicate one, "tp" for a
tensor-parallel matrix, whose FSDP split is then `_StridedShard`, kept as it is: DTensor redistributes from
it) moves whole matrices to ranks, n / ranks each (torch.chunk's split; DTensor runs the all-to-alls). Each rank
orthogonalizes the matrices it received, once in the whole job, and the reverse redistribution hands
every rank the update of its own shard. Mesh dimensions that shard a stack of experts on its expert
dimension (EP, and FSDP's dim-0 split of an EP rank's experts) already give each rank whole experts:
they are left out, so those experts are orthogonalized where they are, without communication.
This module holds no parameter-group policy (train.optim) and no schedule.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr

from moetrain.errors import ConfigError

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
RMS_MATCHING = "match_rms_adamw"  # torch's name for Moonlight's 0.2·sqrt(max(A, B)) scaling


def orthogonalize(matrix: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
    """torch.optim.Muon's Newton–Schulz orthogonalization of a 2-D `matrix`, computed in `dtype`.

    The same operations as `torch.optim._muon._zeropower_via_newtonschulz` (which fixes the dtype to
    bfloat16), except that the normalisation does not write into its input.
    """
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=EPS)
    for _ in range(steps):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    return x.T if tall else x


@dataclass(frozen=True)
class MuonSettings:
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: torch.dtype = torch.bfloat16


@dataclass
class _Matrices:
    """One Muon parameter seen as a stack of matrices [n, A, B] (its local part, and how it is laid out)."""

    param: Tensor
    group: dict
    blocks: int  # column blocks per stacked slice (2 for a fused gate | up weight)
    shape: tuple[int, int]  # (A, B) of each matrix
    mesh: DeviceMesh | None  # the mesh dimensions over which pieces of one matrix are spread, or None
    placements: tuple[Placement, ...]  # the stack's placements on `mesh`
    update: Tensor | None = None  # local [n_local, a, b] pieces of this step's momentum update


@dataclass
class _Bucket:
    """Matrices of one shape and layout, orthogonalized together (one redistribution each way)."""

    members: list[_Matrices] = field(default_factory=list)


def _stack_layout(param: Tensor) -> tuple[DeviceMesh | None, tuple[Placement, ...]]:
    """The mesh dimensions holding pieces of each matrix of `param`, and the [n, A, B] stack's placements there.

    A 2-D parameter's dimensions shift one right in the stack. For a 3-D expert stack, a dimension
    that shards the expert dimension hands each rank whole experts and is left out.
    """
    if not isinstance(param, DTensor):
        return None, ()
    mesh, kept_dims, placements = param.device_mesh, [], []
    shift = 1 if param.ndim == 2 else 0
    for mesh_dim, placement in enumerate(param.placements):
        if param.ndim == 3 and isinstance(placement, Shard | _StridedShard) and placement.dim == 0:
            continue  # splits the experts: whole matrices on each rank
        if isinstance(placement, _StridedShard) and param.ndim == 2:
            # FSDP over a tensor-parallel split of the same dimension (right-to-left sharding): DTensor
            # redistributes from it as it is, so the stack keeps it, one dimension right.
            placements.append(_StridedShard(placement.dim + shift, split_factor=placement.split_factor))
        elif isinstance(placement, _StridedShard):
            raise ConfigError(f"train.optimizer = 'muon' is invalid for an expert stack sharded as {param.placements} "
                              "(its matrices split by tensor parallelism): use train.optimizer = 'adamw'")
        elif isinstance(placement, Shard):
            placements.append(Shard(placement.dim + shift))
        elif isinstance(placement, Replicate):
            placements.append(Replicate())
        else:
            raise ConfigError(f"train.optimizer = 'muon' is invalid for a parameter placed as {param.placements}")
        kept_dims.append(mesh_dim)
    if not kept_dims:
        return None, ()
    if len(kept_dims) == mesh.ndim:
        return mesh, tuple(placements)
    return mesh[tuple(mesh.mesh_dim_names[d] for d in kept_dims)], tuple(placements)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _as_stack(local: Tensor, blocks: int) -> Tensor:
    """A parameter's local tensor as [n, a, b] matrices: 2-D gets a leading 1, column blocks become slices."""
    if local.ndim == 2:
        return local.unsqueeze(0)
    experts, rows, cols = local.shape
    return local.reshape(experts, rows, blocks, cols // blocks).transpose(1, 2).reshape(-1, rows, cols // blocks)


def _from_stack(stack: Tensor, like: Tensor, blocks: int) -> Tensor:
    """The inverse of `_as_stack` for a tensor shaped like `like`."""
    if like.ndim == 2:
        return stack.reshape(like.shape)
    experts, rows, cols = like.shape
    return stack.reshape(experts, blocks, rows, cols // blocks).transpose(1, 2).reshape(like.shape)


class Muon(torch.optim.AdamW):
    """Muon on the param groups with `"muon": True`, torch's AdamW on the others (see the module docstring).

    `column_blocks` maps a 3-D Muon parameter to how many matrices side by side its last dimension holds
    (2 for a fused gate | up expert weight); absent means 1. The learning rate, weight decay and the
    AdamW hyperparameters are per group as in AdamW; Muon's own settings are `settings`.
    """

    def __init__(self, groups: Iterable[dict], *, lr: float, betas: tuple[float, float], eps: float,
                 settings: MuonSettings, column_blocks: dict[Tensor, int] | None = None, fused: bool | None = None):
        groups = [dict(group) for group in groups]
        for group in groups:
            group.setdefault("muon", False)
        super().__init__(groups, lr=lr, betas=betas, eps=eps, fused=fused)
        self.settings = settings
        self._column_blocks = {id(p): n for p, n in (column_blocks or {}).items()}
        self._layouts: dict[int, tuple[DeviceMesh | None, tuple[Placement, ...]]] = {}  # per parameter
        for group in self.param_groups:
            for param in group["params"] if group["muon"] else ():
                self._layouts[id(param)] = self._layout(param)

    def _layout(self, param: Tensor) -> tuple[DeviceMesh | None, tuple[Placement, ...]]:
        """Where the pieces of `param`'s matrices live (`_stack_layout`); refuses what Muon cannot handle."""
        blocks = self._column_blocks.get(id(param), 1)
        if param.ndim not in (2, 3):
            raise ValueError(f"Muon orthogonalizes matrices and stacks of them; a parameter of shape "
                             f"{tuple(param.shape)} must go to an AdamW group")
        if param.shape[-1] % blocks:
            raise ValueError(f"{blocks} column blocks do not divide a parameter of shape {tuple(param.shape)}")
        mesh, placements = _stack_layout(param)
        if blocks > 1 and any(isinstance(p, Shard) and p.dim == 2 for p in placements):
            raise ConfigError(f"train.optimizer = 'muon' is invalid for a gate | up weight sharded as "
                              f"{param.placements} (its columns split)")
        return mesh, placements

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW's step on the AdamW groups (torch's code, run over those groups alone), then Muon's."""
        every_group = self.param_groups
        self.param_groups = [group for group in every_group if not group["muon"]]
        try:
            loss = super().step(closure)
        finally:
            self.param_groups = every_group
        self._muon_step([group for group in every_group if group["muon"]])
        return loss

    def _muon_step(self, groups: list[dict]) -> None:
        buckets: dict[tuple, _Bucket] = {}
        for group in groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                matrices = self._momentum_update(param, group)
                key = (matrices.shape, matrices.mesh, matrices.placements, tuple(matrices.update.shape[1:]))
                buckets.setdefault(key, _Bucket()).members.append(matrices)
        for bucket in buckets.values():
            self._orthogonalize_bucket(bucket)
        for bucket in buckets.values():
            for matrices in bucket.members:
                self._apply(matrices)

    def _momentum_update(self, param: Tensor, group: dict) -> _Matrices:
        """Advance the momentum of `param` (locally: it is sharded like the parameter); its update to orthogonalize."""
        settings = self.settings
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            # A step count as AdamW keeps one: torch's Adam.__setstate__ (load_state_dict) reads every group's.
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        grad, buf = _local(param.grad), _local(state["momentum_buffer"])
        buf.lerp_(grad, 1 - settings.momentum)
        update = grad.lerp(buf, settings.momentum) if settings.nesterov else buf
        blocks = self._column_blocks.get(id(param), 1)
        mesh, placements = self._layouts[id(param)]
        shape = (param.shape[-2], param.shape[-1] // blocks)
        return _Matrices(param, group, blocks, shape, mesh, placements, _as_stack(update, blocks))

    def _orthogonalize_bucket(self, bucket: _Bucket) -> None:
        """Orthogonalize every matrix of the bucket once in the job; each member's `update` becomes its part."""
        first = bucket.members[0]
        stack = torch.cat([m.update for m in bucket.members]) if len(bucket.members) > 1 else first.update
        if first.mesh is None:
            result = self._orthogonalize_all(stack)
        else:
            rows, cols = first.shape
            global_shape = (stack.shape[0], rows, cols)
            stride = (rows * cols, cols, 1)
            owned = [Shard(0)] * first.mesh.ndim
            spread = DTensor.from_local(stack, first.mesh, first.placements, run_check=False, shape=global_shape,
                                        stride=stride)
            mine = spread.redistribute(first.mesh, owned).to_local()
            done = DTensor.from_local(self._orthogonalize_all(mine), first.mesh, owned, run_check=False,
                                      shape=global_shape, stride=stride)
            result = done.redistribute(first.mesh, first.placements).to_local()
        for matrices, part in zip(bucket.members, result.split([m.update.shape[0] for m in bucket.members]),
                                  strict=True):
            matrices.update = part

    def _orthogonalize_all(self, stack: Tensor) -> Tensor:
        """Each [A, B] matrix of a local [k, A, B] stack orthogonalized, back in the stack's dtype."""
        settings = self.settings
        out = torch.empty_like(stack)
        for index in range(stack.shape[0]):
            out[index] = orthogonalize(stack[index], settings.ns_steps, settings.ns_dtype)
        return out

    def _apply(self, matrices: _Matrices) -> None:
        """Decoupled weight decay, then the orthogonalized update at the RMS-matched rate (torch.optim.Muon's order)."""
        lr, weight_decay = matrices.group["lr"], matrices.group["weight_decay"]
        local = _local(matrices.param)
        local.mul_(1 - lr * weight_decay)
        local.add_(_from_stack(matrices.update, local, matrices.blocks),
                   alpha=-_adjust_lr(lr, RMS_MATCHING, torch.Size(matrices.shape)))
        matrices.update = None
