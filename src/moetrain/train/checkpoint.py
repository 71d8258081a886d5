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

`Checkpointer` decides when a run saves (`maybe_save(step)`: every
`checkpoint.every` steps and at the run's last step) and where it resumes from
(`resume_point()`); the functions below it do the saving and loading.
Test hook: with MOETRAIN_TEST_PAUSE_IN_CHECKPOINT_WRITE=<step> in the environment,
rank 0 stops inside the write of that step, after the data files are written and
before the rename, writes `PAUSED` in the temporary directory and sleeps, so a test
can SIGKILL the run mid-write.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from moetrain.config import CheckpointConfig
from moetrain.errors import ConfigError, PoisonedStateError, TrainingDiverged
from moetrain.parallel.collectives import all_gather_objects, all_ranks_true, barrier, distributed, rank_and_world

PAUSE_ENV = "MOETRAIN_TEST_PAUSE_IN_CHECKPOINT_WRITE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    path: Path


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
    if rank_and_world()[0] == 0 and root.is_dir():
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
    return all_ranks_true(all(bool(torch.isfinite(t).all()) for t in tensors))


def capture_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
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
    ranks_state = all_gather_objects(per_rank_state)
    world = len(ranks_state)
    state["trainer"] = pickle.dumps({**trainer_state, "step": step, "world_size": world, "ranks": ranks_state})
    if rank_and_world()[0] == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a stale attempt at this same step
    barrier()
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not distributed())
    barrier()
    if rank_and_world()[0] == 0:
        _maybe_pause_for_test(step, tmp)
        (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": world, "time": time.time()}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in list_complete(root)[:-keep_last]:
            shutil.rmtree(old.path, ignore_errors=True)
    barrier()
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
        dcp.load(state, checkpoint_id=str(ref.path), no_dist=not distributed())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return pickle.loads(state["trainer"])


def load_model_weights(ref: CheckpointRef, model: nn.Module) -> dict[str, Any]:
    """Restore only the model (e.g. for sampling in one process); return the trainer state."""
    state = {"model": get_model_state_dict(model), "trainer": b""}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(ref.path), no_dist=not distributed())
    set_model_state_dict(model, state["model"])
    return pickle.loads(state["trainer"])


class CheckpointState(Protocol):
    """What a checkpoint holds of a trainer: model, optimizer and the small state beside them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def trainer_state(self) -> dict[str, Any]: ...

    def per_rank_state(self) -> dict[str, Any]: ...


class Checkpointer:
    """When a run saves and where it resumes: a run directory's `checkpoints/` under `CheckpointConfig`."""

    def __init__(self, checkpoint_dir: Path, cfg: CheckpointConfig, last_step: int, run_dir_name: str):
        self.dir = Path(checkpoint_dir)
        self.cfg = cfg
        self.last_step = last_step
        self.run_dir_name = run_dir_name

    def resume_point(self) -> CheckpointRef | None:
        """The checkpoint to resume from, or None; refuses to start a fresh run over existing checkpoints."""
        latest = latest_complete(self.dir)
        if latest is not None and not self.cfg.resume:
            raise ConfigError(f"logging.run_dir = {self.run_dir_name!r} already has checkpoints (newest: step "
                              f"{latest.step}); pass --checkpoint.resume True to continue it, or choose another "
                              "--logging.run_dir")
        return latest if self.cfg.resume else None

    def due(self, step: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.every == 0 or step == self.last_step)

    def maybe_save(self, step: int, state: CheckpointState) -> CheckpointRef | None:
        """Save `state` as step `step` when one is due (collective: every rank calls it)."""
        if not self.due(step):
            return None
        try:
            return save_checkpoint(self.dir, step, state.model, state.optimizer, state.trainer_state(),
                                   state.per_rank_state(), self.cfg.keep_last)
        except PoisonedStateError as err:
            raise TrainingDiverged(str(err)) from None

    def latest(self) -> CheckpointRef | None:
        return latest_complete(self.dir)
