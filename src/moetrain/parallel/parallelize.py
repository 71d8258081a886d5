"""Turn a model built on the meta device into the model a run trains: the one place parallelism is applied.

`parallelize_model` applies, in this order, activation checkpointing (recompute each
block in backward), `torch.compile` per block, and FSDP2/HSDP sharding over the mesh
(`moetrain.parallel.shard.apply_fsdp`). Order matters: checkpointing and compile act
on the blocks that FSDP then wraps as its units. The model definition itself stays
free of distributed code; this module changes how the model runs, never what it
computes, and it does not materialise or initialise parameters.

Before all of these, when the mesh has an expert-parallel dimension, `apply_ep` splits
every MoE layer's experts over the EP group and routes their tokens by all-to-all
(`moetrain.parallel.expert_parallel`); FSDP then shards what EP has split.

A one-rank mesh without expert parallelism is not wrapped: FSDP over one rank shards
nothing yet gathered, copied and hooked every unit on every forward and backward (1.6-2x
the bare model's forward+backward on the Qwen3-MoE debug shape). The parameters stay
plain tensors with their global shapes, which is exactly what a sharded run's
checkpoint holds (DCP saves global shapes), so checkpoints move between one rank and
many both ways. Mixed precision on that model is `moetrain.parallel.precision`'s.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh

from moetrain.config import ParallelConfig
from moetrain.errors import ConfigError
from moetrain.parallel.expert_parallel import apply_expert_parallel
from moetrain.parallel.mesh import expert_meshes
from moetrain.parallel.shard import apply_fsdp


def apply_ep(model: nn.Module, mesh: DeviceMesh | None, ep: int) -> None:
    """Split every MoE layer's experts over the mesh's EP group of `ep` ranks (no-op for ep = 1)."""
    experts = expert_meshes(mesh)
    if (1 if experts is None else experts.degree) != ep:
        raise ConfigError(f"parallel.ep = {ep} does not match the mesh ({'no' if experts is None else experts.degree}"
                          " EP dimension): build it with moetrain.parallel.mesh.build_mesh from the same config")
    if experts is not None:
        apply_expert_parallel(model, experts.ep)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of storing them.

    Uses the composable `checkpoint` (hooks, no wrapper module) so parameter names and
    checkpoints are unchanged. Recomputation reruns the MoE forward, which adds the
    block's expert loads to the aux-free load counter a second time: every expert's
    load doubles, so the sign-based bias update is unchanged.
    """
    for block in model.layers:
        checkpoint(block)


def parallelize_model(model: nn.Module, mesh: DeviceMesh | None, parallel: ParallelConfig, *,
                      activation_checkpointing: bool = False, compile: bool = False) -> nn.Module:
    """Apply EP, activation checkpointing, compile and FSDP (not on one rank) to `model` in place; return it."""
    apply_ep(model, mesh, parallel.ep)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        for block in model.layers:
            block.compile()
    if runs_unsharded(mesh):
        return model
    return apply_fsdp(model, mesh, parallel)


def runs_unsharded(mesh: DeviceMesh | None) -> bool:
    """Whether `parallelize_model` leaves the model unwrapped: no mesh, or one rank without expert parallelism."""
    return mesh is None or (mesh.size() == 1 and expert_meshes(mesh) is None)
