"""The [parallel] section: data, sharding and expert parallel sizes, precision, devices; its checks.

Sizes that depend on the world size are checked by `check_world_size` once the world is known;
a rule that also reads the model (parallel.ep against the experts) is JobConfig's. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.config.checks import check, check_positive

DType = Literal["float32", "bfloat16", "float16"]


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's replicate dimension; 1 = plain FSDP)."""
    dp_shard: int = -1
    """Ranks each replica is sharded over (FSDP2); -1 = whatever is left of the world size after dp_replicate."""
    ep: int = 1
    """Expert parallelism: each MoE layer's experts are split into `ep` groups of whole experts,
    over `ep` ranks carved out of dp_shard (tokens travel to their experts by all-to-all);
    expert weights are FSDP-sharded over the dp_shard / ep ranks holding the same experts. 1 = off."""
    sync_policy: Literal["auto", "every_microbatch", "delayed_all_reduce", "final_only"] = "auto"
    """Gradient sync under accumulation; auto = delayed_all_reduce under HSDP with accumulation, else
    every_microbatch (docs/design/parallel.md)."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (FSDP2's ZeRO-3); False keeps them until backward."""
    param_dtype: DType = "float32"
    """Dtype the forward and backward compute in (master weights stay float32)."""
    reduce_dtype: DType = "float32"
    """Dtype gradients are reduced and accumulated in."""
    output_dtype: DType | None = None
    """Dtype of the FSDP units' outputs; None = param_dtype."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto = NCCL on CUDA, gloo on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to compute; auto = CUDA when available."""
    collective_timeout_s: float = 300.0
    """How long a collective waits for its peers before the rank gives up (a hung or lost
    peer); passed to init_process_group. Torch's own default is 30 minutes."""

    def validate(self) -> None:
        """Raise ConfigError (one line) at the first invalid [parallel] field."""
        check_positive(self, "parallel", ("dp_replicate", "ep"))
        check(self.dp_shard == -1 or self.dp_shard >= 1, "parallel.dp_shard", self.dp_shard,
              "must be -1 (auto) or >= 1")
        # At most a year: the process group keeps it as a timedelta in C (days fit an int32, not 1e30 s).
        check(0 < self.collective_timeout_s <= 365 * 86400, "parallel.collective_timeout_s", self.collective_timeout_s,
              "must be a finite number of seconds > 0 (at most a year, 31536000)")


def check_world_size(parallel: ParallelConfig, world_size: int) -> tuple[int, int]:
    """Resolve (dp_replicate, dp_shard) for a world size, or raise ConfigError.

    The expert-parallel group is carved out of the shard dimension, so `parallel.ep` must
    divide dp_shard (every replica group holds every expert).
    """
    replicate = parallel.dp_replicate
    if parallel.dp_shard == -1:
        check(world_size % replicate == 0, "parallel.dp_replicate", replicate,
              f"must divide the world size {world_size}")
        shard = world_size // replicate
    else:
        check(replicate * parallel.dp_shard == world_size, "parallel.dp_shard", parallel.dp_shard,
              f"parallel.dp_replicate x parallel.dp_shard = {replicate} x {parallel.dp_shard} must equal "
              f"the world size {world_size}")
        shard = parallel.dp_shard
    check(shard % parallel.ep == 0, "parallel.ep", parallel.ep,
          f"must divide the data-parallel shard size {shard} (world size {world_size} / parallel.dp_replicate "
          f"{replicate}): the expert-parallel ranks are carved out of it")
    return replicate, shard
