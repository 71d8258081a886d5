"""Host (CPU) memory reuse: large tensors come from the heap and freed memory stays for the next step.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh
mmap and unmaps it on free, so each step's large CPU tensors (a layer's expert-weight
gradients are 100 MiB on the Qwen3-MoE debug shape, the activations of a long row too)
are new zero-filled pages every time: page faults and zeroing cost more than the GEMMs
that fill them. `reuse_freed_host_memory` turns glibc's mmap path off (M_MMAP_MAX = 0)
and raises its trim threshold, so freed blocks are reused by the next step's tensors of
the same sizes. Measured on qwen3_moe_debug, one process, 128-token rows: the backward
took 2-3x less time (docs/results.md, "Step time"). The heap then keeps its
high-water mark instead of returning memory between steps; the peak itself is unchanged.

One process only: with several ranks on one host each rank's heap then keeps its own high-water
mark, and on 4 gloo ranks of qwen3_moe_debug (128-token rows) a rank grew to 6.3 GB of anonymous
memory, killed by the OOM killer on a 24 GiB machine, where the same job without the setting
peaked at 2.5 GB per rank (benchmarks/ab/step_time_ab.py, side by side). Only on glibc (Linux);
elsewhere it does nothing.

Several ranks keep torch's allocator as it is: huge pages stay off (THP_MEM_ALLOC_ENABLE=0 unless
the user set it). With THP_MEM_ALLOC_ENABLE=1, torch aligns tensors of 2 MiB and more to 2 MiB and
madvises them for transparent huge pages, so a fresh 150 MiB FSDP buffer costs 75 page faults
instead of 38 400; on 4 gloo ranks of qwen3_moe_debug (128-token rows) that once made a step 26 s
instead of 41 s. But each rank's resident set then kept growing: tiny_moe on 2 ranks grew from
0.96 to 1.65 GB per rank over 45 steps, while the same job without huge pages stayed at 0.77-0.80 GB
(docs/design/performance.md, "Fresh pages on every rank"). FSDP's communication buffers are now reused on gloo
(parallel/gloo_comms.py), which removes most of the fresh-page cost huge pages paid for. A value
the user set wins, so huge pages remain one variable away.

This module sets process-wide allocator options; it must not import torch (the environment
variable is read when torch loads), allocate tensors or change what is computed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from moetrain.libc import M_MMAP_MAX, M_TRIM_THRESHOLD, glibc_mallopt

_MAX_INT = 2**31 - 1
TORCH_THP_VARIABLE = "THP_MEM_ALLOC_ENABLE"


def rank_environment(world_size: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The allocator variables a rank of a `world_size` job runs with (a value already set wins)."""
    if world_size <= 1:
        return {}
    return {TORCH_THP_VARIABLE: environ.get(TORCH_THP_VARIABLE, "0")}


def huge_pages_for_large_tensors(environ: MutableMapping[str, str] = os.environ) -> bool:
    """On a rank of a multi-rank job (torchrun's WORLD_SIZE > 1), pin torch's huge-page allocation (off
    unless the user set THP_MEM_ALLOC_ENABLE). Must run before torch is imported. Returns whether it is on.
    """
    environ.update(rank_environment(int(environ.get("WORLD_SIZE", "1")), environ))
    return environ.get(TORCH_THP_VARIABLE) == "1"


def reuse_freed_host_memory(world_size: int, frozen_base: bool = False) -> bool:
    """Apply the glibc options above to a one-process job; return whether they took effect.

    Not for LoRA (`frozen_base`): its largest per-step tensors, the experts' folded weights, already reuse one
    buffer each (moetrain.model.lora), so the heap's kept high-water mark is mostly slack between the adapters'
    small tensors (docs/results.md, "LoRA: memory ... (round 20)" and "(round 21)")."""
    if world_size != 1 or frozen_base:
        return False
    mallopt = glibc_mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, _MAX_INT))
