"""Checkpoints with torch.distributed.checkpoint (DCP): written whole or not at all.

A checkpoint is a directory `RUN_DIR/checkpoints/step_00000100/` holding the DCP
files of the model and optimizer state (sharded tensors stay sharded: each rank
writes its own shards, and DCP can reshard them on load into a different mesh),
plus one pickled `trainer` entry with the step, the schedule's step, counters and
every rank's loader position and RNG states (gathered, so one copy serves all
ranks), and `meta.json` (step, world size, time).

Atomicity: all ranks write into `checkpoints/.tmp-step_00000100/`; only when every
rank has finished does rank 0 add `meta.json` and rename the directory to its final
name. A rename within one directory is atomic, so a `step_*` directory is always
complete; a run killed mid-write leaves only a `.tmp-*` directory, which is never
read and is deleted by the next save or resume. Before writing, the model and
optimizer state are checked to be finite on every rank, so a diverged run cannot
leave a poisoned checkpoint. The newest `keep_last` complete checkpoints are kept.

This module saves and restores state; it does not decide when (the trainer does).
Test hook: with MOETRAIN_TEST_PAUSE_IN_CHECKPOINT_WRITE=<step> in the environment,
rank 0 stops inside the write of that step, after the data files are written and
before the rename, writes `PAUSED` in the temporary directory and sleeps, so a test
can SIGKILL the run mid-write.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

PAUSE_ENV = "MOETRAIN_TEST_PAUSE_IN_CHECKPOINT_WRITE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class PoisonedStateError(RuntimeError):
    """The state to be saved holds NaN or inf; nothing was written."""


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    path: Path


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every single-process save/load that it assumes one process; that is
    # exactly the intent here, so the warning is noise.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_complete(checkpoint_dir: str | Path) -> list[CheckpointRef]:
    """Complete checkpoints (final name, DCP metadata and meta.json present), oldest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    refs = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / ".metadata").is_file() and (entry / "meta.json").is_file():
            refs.append(CheckpointRef(int(match.group(1)), entry))
    return sorted(refs, key=lambda r: r.step)


def latest_complete(checkpoint_dir: str | Path) -> CheckpointRef | None:
    refs = list_complete(checkpoint_dir)
    return refs[-1] if refs else None


def remove_partial(checkpoint_dir: str | Path) -> list[Path]:
    """Delete temporary directories left by interrupted writes (rank 0 only)."""
    root = Path(checkpoint_dir)
    removed = []
    if _rank() == 0 and root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(".tmp-"):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _all_finite(state: Any) -> bool:
    """True when every floating-point tensor in `state` is finite on every rank."""
    tensors = []

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if torch.is_floating_point(obj):
                tensors.append(_local(obj))
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)

    walk(state)
    finite = all(bool(torch.isfinite(t).all()) for t in tensors)
    if _distributed():
        flag = torch.tensor([1 if finite else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        finite = bool(flag.item())
    return finite


def _gather(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def capture_rng_state() -> dict[str, Any]:
    import random

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import random

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(checkpoint_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], per_rank_state: dict[str, Any], keep_last: int) -> CheckpointRef:
    """Write a complete checkpoint for `step` (collective: every rank calls it).

    `trainer_state` must be the same on every rank; `per_rank_state` (loader position,
    RNG states) is gathered from every rank and stored as a list indexed by rank.
    """
    root = Path(checkpoint_dir)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    if not _all_finite(state):
        raise PoisonedStateError(f"refusing to save step {step}: the model or optimizer state holds NaN/inf")
    ranks_state = _gather(per_rank_state)
    world = len(ranks_state)
    state["trainer"] = pickle.dumps({**trainer_state, "step": step, "world_size": world, "ranks": ranks_state})
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a stale attempt at this same step
    _barrier()
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not _distributed())
    _barrier()
    if _rank() == 0:
        _maybe_pause_for_test(step, tmp)
        (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": world, "time": time.time()}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in list_complete(root)[:-keep_last]:
            shutil.rmtree(old.path, ignore_errors=True)
    _barrier()
    return CheckpointRef(step, final)


def _maybe_pause_for_test(step: int, tmp: Path) -> None:
    if os.environ.get(PAUSE_ENV) == str(step):
        (tmp / "PAUSED").write_text("paused inside the checkpoint write for a kill test\n")
        while True:  # until the test kills this process
            time.sleep(1)


def _fsync_dir(path: Path) -> None:
    # Make the rename durable across a power loss, not only a process kill.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(ref: CheckpointRef, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore model and optimizer in place (resharding as needed); return the trainer state."""
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer),
             "trainer": b""}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(ref.path), no_dist=not _distributed())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return pickle.loads(state["trainer"])


def load_model_weights(ref: CheckpointRef, model: nn.Module) -> dict[str, Any]:
    """Restore only the model (e.g. for sampling in one process); return the trainer state."""
    state = {"model": get_model_state_dict(model), "trainer": b""}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(ref.path), no_dist=not _distributed())
    set_model_state_dict(model, state["model"])
    return pickle.loads(state["trainer"])
