"""Turn a model built on the meta device into the model a run trains: the one place parallelism is applied.

`parallelize_model` applies, in this order, activation checkpointing (recompute each
block in backward), `torch.compile` per block, and FSDP2/HSDP sharding over the mesh
(`moetrain.parallel.shard.apply_fsdp`). Order matters: checkpointing and compile act
on the blocks that FSDP then wraps as its units. The model definition itself stays
free of distributed code; this module changes how the model runs, never what it
computes, and it does not materialise or initialise parameters.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh

from moetrain.config import JobConfig
from moetrain.parallel.shard import apply_fsdp


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of storing them.

    Uses the composable `checkpoint` (hooks, no wrapper module) so parameter names and
    checkpoints are unchanged. Recomputation reruns the MoE forward, which adds the
    block's expert loads to the aux-free load counter a second time: every expert's
    load doubles, so the sign-based bias update is unchanged.
    """
    for block in model.layers:
        checkpoint(block)


def parallelize_model(model: nn.Module, mesh: DeviceMesh | None, cfg: JobConfig) -> nn.Module:
    """Apply activation checkpointing, compile and FSDP to `model` in place per `cfg`; return it."""
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.train.compile:
        for block in model.layers:
            block.compile()
    return apply_fsdp(model, mesh, cfg.parallel)
