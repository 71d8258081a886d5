"""Refuse a job whose estimated memory obviously exceeds the machine's, before anything is allocated.

`refuse_if_too_big(cfg)` runs first in a training run, before the data is read, the model
built or anything written to the run directory. It compares the per-rank estimate of
`moetrain.model.memory_estimate` (parameters and optimizer state, one microbatch's
activations, the attention mask) with the memory the ranks will have: on CPU the machine's
physical memory shared by the ranks on this machine, on CUDA one device's memory per rank.
On CPU a process's address-space limit (RLIMIT_AS: `ulimit -v`, `prlimit --as`) bounds it too:
the limit less what the process has already mapped (its libraries, torch) is what it can still
allocate, however much memory the machine has.
The estimate counts only what certainly gets allocated, so a refusal is never a false alarm;
a job that passes may still run out of memory. A refusal is one ConfigError line (exit 2)
that says the estimate, its parts, the memory available and which fields to change.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import torch
import torch.distributed as dist

from moetrain.config.job import JobConfig
from moetrain.config.parallel import check_world_size
from moetrain.errors import ConfigError
from moetrain.model.memory_estimate import MemoryEstimate, estimate_training_memory, format_bytes
from moetrain.parallel.collectives import distributed, rank_and_world


def physical_memory_bytes() -> int | None:
    """This machine's physical memory (MemTotal of /proc/meminfo, else sysconf), or None when unknown."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # reported in kB
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def address_space_left() -> tuple[int, int] | None:
    """(bytes this process may still map under RLIMIT_AS, the limit), or None when it is unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    mapped = 0
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmSize:"):
                mapped = int(line.split()[1]) * 1024  # reported in kB
    return max(soft - mapped, 0), soft


def job_device_type(cfg: JobConfig) -> str:
    """"cuda" or "cpu": where the job will run, decided before its process group or model exists."""
    # The rule of moetrain.parallel.mesh, evaluated before the process group exists.
    parallel = cfg.parallel
    if parallel.device != "auto":
        return parallel.device
    if distributed():
        return "cuda" if dist.get_backend() == "nccl" else "cpu"
    return "cuda" if parallel.backend != "gloo" and torch.cuda.is_available() else "cpu"


def _ranks() -> tuple[int, int]:
    """(world size, ranks on this machine), from the process group or torchrun's environment."""
    world = rank_and_world()[1] if distributed() else int(os.environ.get("WORLD_SIZE", "1"))
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def _what_to_change(estimate: MemoryEstimate) -> str:
    largest = max((estimate.attention_mask, "mask"), (estimate.activations, "activations"),
                  (estimate.parameters, "parameters"))[1]
    if largest == "mask":
        return "lower data.seq_len (the mask grows with its square) or train.microbatch_size"
    if largest == "activations":
        return "lower train.microbatch_size or data.seq_len, or set train.activation_checkpointing True"
    return "shrink the model (model.dim, model.n_layers, model.moe.n_experts) or shard it over more ranks"


def refuse_if_too_big(cfg: JobConfig) -> MemoryEstimate:
    """Raise ConfigError when the job cannot fit; return the estimate otherwise."""
    world, local = _ranks()
    _, dp_shard = check_world_size(cfg.parallel, world)
    # Under pipeline parallelism a rank holds its stages: on average 1/pp of the parameters (a lower bound).
    estimate = estimate_training_memory(cfg, dp_shard * cfg.parallel.pp)
    if job_device_type(cfg) == "cuda":
        device = int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)
        available, sharers, where = torch.cuda.get_device_properties(device).total_memory, 1, "CUDA device"
    else:
        available, sharers, where = physical_memory_bytes(), local, "machine (CPU)"
        limited = address_space_left()
        if limited is not None and estimate.total > limited[0] and (
                available is None or estimate.total * sharers <= available):
            raise ConfigError(f"this job needs an estimated {estimate.describe()} per rank, more than the "
                              f"{format_bytes(limited[0])} this process may still allocate under its address-"
                              f"space limit (RLIMIT_AS, ulimit -v) of {format_bytes(limited[1])}; raise the limit "
                              f"or {_what_to_change(estimate)}")
    if available is None or estimate.total * sharers <= available:
        return estimate
    shared = f" shared by {sharers} ranks" if sharers > 1 else ""
    raise ConfigError(f"this job needs an estimated {estimate.describe()} per rank, more than the "
                      f"{format_bytes(available)} of this {where}{shared} (train.microbatch_size = "
                      f"{cfg.train.microbatch_size}, data.seq_len = {cfg.data.seq_len}); {_what_to_change(estimate)}")
