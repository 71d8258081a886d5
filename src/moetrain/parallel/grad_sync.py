"""Gradient accumulation under FSDP2/HSDP: sync policies, global token count, clipping.

A sync policy is data: for each microbatch position (not last / last) the two FSDP
flags, `requires_gradient_sync` (reduce-scatter over the shard dim at all) and
`requires_all_reduce` (all-reduce over the replicate dim). `accumulation()` walks the
microbatches and sets both flags on every FSDP unit before each one, so a training
loop cannot forget or mis-order them. `count_global_tokens` makes the one all-reduce
per step that the token-weighted loss needs (the caller counts its own valid
targets), and `clip_grad_norm_` clips by the norm of the full (sharded and
replicated) gradient. This module decides when gradients move; it must not compute
losses or step optimizers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from moetrain.config.parallel import ParallelConfig
from moetrain.errors import ConfigError
from moetrain.parallel.collectives import all_reduce_int, collective_device
from moetrain.parallel.mesh import MeshDims
from moetrain.parallel.shard import fsdp_modules

Microbatch = TypeVar("Microbatch")


@dataclass(frozen=True)
class SyncFlags:
    requires_gradient_sync: bool
    requires_all_reduce: bool


@dataclass(frozen=True)
class SyncPolicy:
    name: str
    not_last: SyncFlags
    last: SyncFlags

    def flags(self, is_last: bool) -> SyncFlags:
        return self.last if is_last else self.not_last


_FULL_SYNC = SyncFlags(requires_gradient_sync=True, requires_all_reduce=True)

# The whole policy space. Every policy syncs fully on the last microbatch, so the
# gradients after a step are identical; they differ in when communication happens
# and how much unsharded gradient memory is held in between.
SYNC_POLICIES: dict[str, SyncPolicy] = {
    # Reduce-scatter and replicate all-reduce after every microbatch (FSDP2 default).
    "every_microbatch": SyncPolicy("every_microbatch", not_last=_FULL_SYNC, last=_FULL_SYNC),
    # Reduce-scatter every microbatch (gradient memory stays sharded); the replicate
    # all-reduce waits for the last one, so replica groups synchronise once per step.
    "delayed_all_reduce": SyncPolicy(
        "delayed_all_reduce",
        not_last=SyncFlags(requires_gradient_sync=True, requires_all_reduce=False),
        last=_FULL_SYNC),
    # No collective until the last microbatch; unsharded gradients are held meanwhile.
    "final_only": SyncPolicy(
        "final_only",
        not_last=SyncFlags(requires_gradient_sync=False, requires_all_reduce=False),
        last=_FULL_SYNC),
}


def resolve_sync_policy(parallel: ParallelConfig, dims: MeshDims, grad_accum: int) -> SyncPolicy:
    """The configured policy; "auto" = delayed_all_reduce when gradients are replicated
    (dp_replicate > 1: HSDP or pure replication) and accumulated, else every_microbatch; under
    pipeline parallelism final_only, what torch's schedule does (the others are refused)."""
    name = parallel.sync_policy
    if dims.pp > 1:
        # torch's pipeline stages sync once, after the schedule's last backward (PipelineStage.perform_reduce_grad).
        if name not in ("auto", "final_only"):
            raise ConfigError(f"parallel.sync_policy = {name!r} is invalid with parallel.pp > 1: the schedule reduces "
                              "once after its last backward; use auto or final_only")
        return SYNC_POLICIES["final_only"]
    if name == "auto":
        name = "delayed_all_reduce" if dims.dp_replicate > 1 and grad_accum > 1 else "every_microbatch"
    if name not in SYNC_POLICIES:
        raise ConfigError(f"parallel.sync_policy = {name!r} is invalid: use auto or one of {sorted(SYNC_POLICIES)}")
    return SYNC_POLICIES[name]


def set_sync_flags(model: nn.Module, flags: SyncFlags) -> None:
    """Set both FSDP flags on every unit of the model (no-op for an unsharded model)."""
    for unit in fsdp_modules(model):
        # Order matters: set_requires_gradient_sync sets the all-reduce flag too.
        unit.set_requires_gradient_sync(flags.requires_gradient_sync, recurse=False)
        unit.set_requires_all_reduce(flags.requires_all_reduce, recurse=False)


def accumulation(
    model: nn.Module, microbatches: Iterable[Microbatch], policy: SyncPolicy
) -> Iterator[tuple[Microbatch, bool]]:
    """Yield (microbatch, is_last), with the policy's FSDP flags set for that microbatch.

    Run forward and backward of each microbatch inside the loop body: the flags are
    read by FSDP during that backward. Works on any iterable (one microbatch of
    lookahead finds the last). On exit, even an early one, the model is left fully
    synchronising so that a later forward/backward outside the loop is not silently
    left unreduced.
    """
    iterator = iter(microbatches)
    try:
        current = next(iterator)
    except StopIteration:
        return
    try:
        while True:
            try:
                following = next(iterator)
                is_last = False
            except StopIteration:
                is_last = True
            set_sync_flags(model, policy.flags(is_last))
            yield current, is_last
            if is_last:
                return
            current = following
    finally:
        set_sync_flags(model, _FULL_SYNC)


def count_global_tokens(local_count: int, group: dist.ProcessGroup | None = None, replicas: int = 1) -> int:
    """The step's valid target tokens over all ranks of `group`, from this rank's count.

    Exactly one all-reduce (None = the default group; no process group = the local
    count). Every rank must call it, also a rank whose microbatches hold no valid target.
    `replicas`: how many ranks count the same microbatches (context x tensor parallel ranks,
    `JobMesh.sequence_split`); the sum counts each microbatch that often and is divided back.
    """
    total = all_reduce_int(local_count, group)
    if total % replicas:
        raise RuntimeError(f"{total} valid tokens summed over ranks is not a multiple of {replicas} replicas: "
                           "ranks of one context/tensor-parallel group counted different microbatches")
    return total // replicas


def _params_by_grad_mesh(model: nn.Module) -> dict[object, list[nn.Parameter]]:
    """Parameters with a gradient, grouped by the gradient's DTensor mesh (None: plain tensors).

    DTensor ops never mix meshes, and expert-parallel gradients live on their own mesh.
    """
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for param in model.parameters():
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(param)
    return by_mesh


def grad_norm(model: nn.Module, norm_type: float = 2.0, pipeline: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Norm of the full gradient, identical on every rank (a float32 scalar, local tensor).

    DTensor gradients (FSDP: Shard on dp_shard, Replicate on dp_replicate) reduce their
    partial norms over the shard dim only, so replicas are not double counted. Expert-parallel
    gradients live on another mesh than the rest, so each mesh's norm is reduced on its own
    and the per-mesh norms are combined (a norm of norms). Under pipeline parallelism `model`
    holds this rank's stages only: the stages' norms are combined over the `pipeline` group.
    """
    by_mesh = _params_by_grad_mesh(model)
    norms = []
    for params in by_mesh.values():
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=norm_type, foreach=None)
        norms.append((total.full_tensor() if isinstance(total, DTensor) else total).float())
    if pipeline is not None:  # a stage may hold no gradient at all: it still joins the sum
        device = collective_device(pipeline)
        powered = sum((norm.to(device) ** norm_type for norm in norms), torch.zeros((), device=device))
        dist.all_reduce(powered, group=pipeline)
        return powered ** (1.0 / norm_type)
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    pipeline: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; return the norm before clipping.

    `max_norm <= 0` or infinite only measures. A non-finite norm is returned as is and
    gradients are left untouched, so the caller's NaN policy can decide (skip/stop).
    `pipeline`: the pipeline group whose other stages hold the rest of the gradient (see grad_norm).
    """
    total = grad_norm(model, norm_type, pipeline)
    if max_norm <= 0 or math.isinf(max_norm) or not torch.isfinite(total):
        return total
    for params in _params_by_grad_mesh(model).values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(params[0].grad.device))
    return total
