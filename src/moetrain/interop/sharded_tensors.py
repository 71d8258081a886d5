"""Shard-local tensor helpers for import and export: plain tensors and FSDP's DTensors alike.

Each rank touches only its own slices; the helpers that gather (`full`, `by_rows`) are collectives
every rank must call in the same order. This module moves tensor data; it must not know model
names, file formats or families.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_view(t: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """(local tensor, its offset in the global tensor)."""
    if isinstance(t, DTensor):
        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(offset)
    return t, (0,) * t.dim()


def by_rows(t: Tensor) -> Tensor:
    """`t` laid out so that every rank holds whole rows (whole experts) of dim 0.

    FSDP shards dim 0 already; expert parallelism may have FSDP shard an expert block on dim 1
    (`moetrain.parallel.shard`), and then the same values are redistributed with those shards
    gathered (a collective: every rank calls it in the same order). Each rank then holds only
    its own experts, whole.
    """
    if not isinstance(t, DTensor) or all(not isinstance(p, Shard) or p.dim == 0 for p in t.placements):
        return t
    rows = [p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in t.placements]
    return t.redistribute(t.device_mesh, rows)


def local_rows(t: Tensor) -> tuple[Tensor, int]:
    """(local tensor, first global row) of a tensor sharded, if at all, along dim 0 only (see `by_rows`)."""
    if isinstance(t, DTensor) and any(isinstance(p, Shard) and p.dim != 0 for p in t.placements):
        raise ValueError(f"expected sharding along dim 0, got placements {t.placements}")
    local, offset = local_view(t)
    return local, offset[0]


def full(t: Tensor) -> Tensor:
    """The whole tensor (a collective for a DTensor: every rank must call it in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def copy_full_into(param: Tensor, whole: Tensor) -> None:
    """Copy into `param`'s local shard its slice of the whole tensor `whole`."""
    local, offset = local_view(param)
    local.copy_(whole[tuple(slice(o, o + s) for o, s in zip(offset, local.shape, strict=True))])


def rows_like(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """An empty tensor of `shape`, sharded along dim 0 exactly like `t` (whose dim 0 has the same length)."""
    local, _ = local_view(t)
    buffer = torch.empty((local.shape[0], *shape[1:]), dtype=local.dtype, device=local.device)
    if not isinstance(t, DTensor):
        return buffer
    return DTensor.from_local(buffer, t.device_mesh, t.placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def back_into(param: Tensor, rows: Tensor) -> None:
    """Copy `rows` (a `by_rows` copy of the DTensor `param`) back into param's own layout (a collective)."""
    local_view(param)[0].copy_(rows.redistribute(param.device_mesh, param.placements).to_local())


def rope_reorder(t: Tensor, head_dim: int, order: Tensor) -> Tensor:
    """Reorder the channels of every head along dim 0 of a q/k projection or QK-norm weight."""
    return t.reshape(-1, head_dim, *t.shape[1:])[:, order.to(t.device)].reshape(t.shape)
