"""Checkpoints: written whole or not at all, verified before anything reads them, never unpickled.

A checkpoint is a directory `RUN_DIR/checkpoints/step_00000100/` holding

- `tensors/*.safetensors`: the model and optimizer tensors, written through torch.distributed.checkpoint
  (DCP) with its safetensors storage. Sharded tensors stay sharded: each rank writes one file with its
  own shards and their offsets (in the file's JSON header), and on load DCP reads, from every file,
  the pieces that the loading rank's shards need, so a checkpoint reshards to any mesh, world size
  and expert-parallel layout. Optimizer hyperparameters (param groups) are not stored: they come
  from the config, and the learning rate is set by the schedule every step.
- `trainer.json` (+ `trainer_tensors.safetensors`): the step, counters and every rank's
  `per_rank_state()` (loader position, RNG states), gathered so one copy serves all ranks. Any
  tensor inside is stored in the safetensors file and referenced from the JSON.
- `config.json`: the job's config at the save, compared with a resuming job's before anything loads.
- `meta.json`: step, world size, time.
- `manifest.json`: the sha256 and size of every other file, written last.

What loading trusts: nothing is unpickled. Files are parsed only as JSON and safetensors (whose
header is JSON and whose payload is raw tensor bytes), and only after every file in the directory
has matched its sha256 in the manifest and no file outside the manifest is present. sha256 rather
than a cheaper checksum (crc32, xxhash): it is in the standard library, any machine can recheck a
copied checkpoint with `sha256sum`, no accidental or crafted match is within reach, and its cost
is one pass over the bytes: 0.19x the time of a whole save of the default model's checkpoint,
crc32 being 0.34x of sha256 (benchmarks/checkpoint_hash_cost.py, docs/reliability.md). The manifest
lives beside the files, so it detects damage (flipped bytes, truncation, missing or extra files),
not deliberate tampering: someone who can write the directory can rewrite the manifest too. That
is safe because the loader cannot execute code whatever the files contain.

Fallback: `newest_intact()` verifies checkpoints newest first and returns the first intact one
with one line per skipped one naming its bad file; with none intact a resume stops with one line.

Atomicity: all ranks write into `checkpoints/.tmp-step_00000100/`; only when every rank has
finished does rank 0 add the state, config, meta and manifest files and rename the directory to
its final name. A rename within one directory is atomic, so a `step_*` directory is always
complete; a run killed mid-write leaves only a `.tmp-*` directory, which is never read and is
deleted by the next save or resume. Before writing, the model and optimizer state are checked to
be finite on every rank, so a diverged run cannot leave a poisoned checkpoint.

Pruning (`prune`, after each save): the checkpoint just written and the one the run resumed from
are never deleted; checkpoints newer than the one just written are deleted first (a resume only
passes over damaged ones, so they are known-damaged or belong to a history the run has left);
of the older ones the newest `keep_last - 1` stay.

The small state is checked before it is used: `trainer.json` must hold the step, world size and
per-rank entries of the types the trainer writes (an RNG state of the right size), `meta.json` a
JSON object; anything else, however consistent with the manifest, is one ConfigError line.

Asynchronous saves (`checkpoint.async_save`): the training loop captures the state of the step
and returns; the rest of the save runs in a background thread. Captured on the loop: the small
state (step, counters, every rank's loader position and RNG states, gathered and turned into JSON
and tensor copies right there, so it is that step's state whatever the loop does next) and a copy
of the model and optimizer tensors in host memory (DCP's `DefaultStager`: a device-to-host copy on
a GPU, a memory copy on a CPU; its buffers are kept and reused by later saves). In the background,
unchanged: the finiteness check, DCP's write of every rank's shards, the hashing, the manifest, the
rename and the prune, in that order; the rename still comes only after every rank's files are
written and hashed, so a crash at any point of a background save leaves a `.tmp-*` directory and
the previous checkpoint intact. The background thread's collectives run on a process group of
their own (gloo, what DCP's `async_save` requires too): a group orders its collectives by call,
and the training loop's collectives on the default group would interleave with the save's. At
most one save is in flight: the next save, the end of the run and a signal's stop wait for it,
and a failure in the background (a full disk, a non-finite state, a lost peer) is raised there,
on the training loop of every rank, as the same error a synchronous save raises. Pruning happens
only inside a save, after its rename, so it never races another save. This is DCP's thread-based
`async_save` (stage, then `save` in a thread) with the completion steps in the same thread, and
one change: the tensor files are written by `_UnblockingSafetensorsWriter` (the files of DCP's
safetensors writer, written tensor by tensor) because DCP's writer serializes a whole file in one
call that holds the GIL, stopping the training loop for as long.

`Checkpointer` decides when a run saves (`maybe_save(step)`: every `checkpoint.every` steps and at
the run's last step) and where it resumes from (`resume_point()`: per `checkpoint.resume` =
true/false/"auto", the newest intact checkpoint, after comparing the job's config with the
checkpoint's). This module never reads a file it has not verified and never writes outside the
checkpoint directory.

Test hooks (`moetrain.runtime.faults`) pause inside a write, fail a write or crash after a step on request.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._hf_utils import (
    DCP_VERSION_KEY,
    FORMAT_KEY,
    FORMAT_VALUE,
    HF_DCP_VERSION,
    _gen_file_name,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from moetrain.config.checkpoint import CheckpointConfig
from moetrain.config.job import JobConfig, from_dict
from moetrain.durable import file_sha256, fsync_dir, write_durably
from moetrain.errors import ConfigError, PoisonedStateError, TrainingDiverged
from moetrain.logging import get_logger
from moetrain.parallel.collectives import all_gather_objects, all_ranks_true, barrier, distributed, rank_and_world
from moetrain.runtime import faults

TENSORS_DIR = "tensors"
TRAINER_FILE = "trainer.json"
TRAINER_TENSORS_FILE = "trainer_tensors.safetensors"
CONFIG_FILE = "config.json"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
FORMAT = "moetrain-checkpoint-v2"
DCP_SHARDING_KEY = "DCP_SHARDING_INFO"  # a tensor file's header metadata: each tensor's offsets in the whole
TENSOR_REF = "__tensor__"  # {"__tensor__": key}: a tensor stored in trainer_tensors.safetensors

# Fields a resumed job may change without changing what the checkpoint means: how the initial
# weights were made (the checkpoint replaces them), the expert kernel (same parameters, same
# function) and whether unreadable files are skipped (a corpus that loads is the same corpus).
RESUME_MAY_DIFFER = frozenset({"model.init_from", "model.init_scheme", "model.init_scale_embedding",
                               "model.moe.impl", "data.skip_bad_files"})

_STEP_DIR = re.compile(r"^step_(\d+)$")

log = get_logger("checkpoint")


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    path: Path
    verified: bool = False  # its files matched the manifest (set by verify/newest_intact)


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every single-process save/load that it assumes one process; that is
    # exactly the intent here, so the warning is noise.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _ignore_single_process_warning() -> None:
    # For background saves in one process: `warnings.catch_warnings` swaps the process-wide filters
    # and is not safe from two threads, so the filter of `_quiet_single_process` is installed once.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_complete(checkpoint_dir: str | Path) -> list[CheckpointRef]:
    """Checkpoints under their final name (whole when written; `verify` says whether still intact), oldest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    refs = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
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


# ---------------------------------------------------------------------------------------------
# Integrity: the manifest


def _files_under(root: Path) -> list[str]:
    """Every file below `root` as a '/'-separated relative path, sorted (symlinks count as files)."""
    found = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            found.append((Path(dirpath) / name).relative_to(root).as_posix())
    return sorted(found)


def _manifest_entries(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: {"sha256": file_sha256(root / name), "bytes": (root / name).stat().st_size} for name in names}


def _read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    """The manifest's file entries; ValueError (one line) when it is not a manifest of this format."""
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"is not readable JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("algorithm") != "sha256":
        raise ValueError(f"is not a {FORMAT} sha256 manifest")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(name, str) and isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("bytes"), int) for name, entry in files.items()):
        raise ValueError("has a malformed file list")
    for name in files:
        if name.startswith("/") or ".." in name.split("/") or name == MANIFEST_FILE:
            raise ValueError(f"names a file outside its checkpoint: {name!r}")
    return files


def _local_problem(path: Path, part: int, parts: int) -> str | None:
    """What is wrong with checkpoint `path` (one line naming the file), checking every `parts`-th file from `part`."""
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        if (path / ".metadata").exists():
            return (f"{path} was written by an older moetrain (pickled DCP metadata, no {MANIFEST_FILE}); "
                    "such checkpoints are not loaded")
        return f"{manifest} is missing"
    try:
        entries = _read_manifest(manifest)
    except ValueError as err:
        return f"{manifest} {err}"
    present = set(_files_under(path)) - {MANIFEST_FILE}
    for name in sorted(present - entries.keys()):
        return f"{path / name} is not in the checkpoint's manifest"
    for name in sorted(entries.keys() - present):
        return f"{path / name} is missing"
    for name in sorted(entries)[part::parts]:
        file = path / name
        if file.is_symlink() or not file.is_file():  # a link to /dev/zero or a FIFO would never finish hashing
            return f"{file} is not a regular file"
        size = file.stat().st_size
        if size != entries[name]["bytes"]:
            return f"{file} has {size} bytes, the manifest says {entries[name]['bytes']} (truncated or damaged)"
        if file_sha256(file) != entries[name]["sha256"]:
            return f"{file} does not match its sha256 in the manifest (damaged)"
    return None


def verify(ref: CheckpointRef) -> tuple[CheckpointRef, str | None]:
    """(ref marked verified, None) when every file matches the manifest, else (ref, one line naming the file).

    Collective under torch.distributed (every rank calls it): each rank hashes its share of the
    files and all ranks get the same answer.
    """
    rank, world = rank_and_world()
    problems = all_gather_objects(_local_problem(ref.path, rank, world))
    problem = next((p for p in problems if p is not None), None)
    return (ref if problem else replace(ref, verified=True)), problem


def newest_intact(checkpoint_dir: str | Path) -> tuple[CheckpointRef | None, list[str]]:
    """The newest checkpoint whose files all match its manifest, and one line per newer, damaged one.

    Collective under torch.distributed. Logs nothing: the caller says what the skipped ones mean.
    """
    skipped = []
    for ref in reversed(list_complete(checkpoint_dir)):
        checked, problem = verify(ref)
        if problem is None:
            return checked, skipped
        skipped.append(problem)
    return None, skipped


def _require_verified(ref: CheckpointRef) -> CheckpointRef:
    if ref.verified:
        return ref
    checked, problem = verify(ref)
    if problem is not None:
        raise ConfigError(f"checkpoint {ref.path} is damaged: {problem}")
    return checked


# ---------------------------------------------------------------------------------------------
# Small state as JSON (+ safetensors for the tensors inside it)


def _to_json(obj: Any, tensors: dict[str, torch.Tensor], key: str) -> Any:
    if isinstance(obj, torch.Tensor):
        # A copy: safetensors refuses tensors that share memory, and views of larger storages.
        tensors[key] = obj.detach().cpu().clone().contiguous()
        return {TENSOR_REF: key}
    if isinstance(obj, dict):
        out = {}
        for name, value in obj.items():
            if not isinstance(name, str) or name == TENSOR_REF:
                raise TypeError(f"checkpoint state {key}: key {name!r} cannot be stored (string keys only, "
                                f"not {TENSOR_REF!r})")
            out[name] = _to_json(value, tensors, f"{key}.{name}")
        return out
    if isinstance(obj, (list, tuple)):  # tuples come back as lists
        return [_to_json(value, tensors, f"{key}.{i}") for i, value in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):  # a numpy scalar (e.g. from an index computation) as its Python value
        return obj.item()
    raise TypeError(f"checkpoint state {key}: a {type(obj).__name__} cannot be stored as JSON or a tensor")


def _from_json(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {TENSOR_REF}:
            return tensors[obj[TENSOR_REF]]
        return {name: _from_json(value, tensors) for name, value in obj.items()}
    if isinstance(obj, list):
        return [_from_json(value, tensors) for value in obj]
    return obj


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from None
    except RecursionError:
        raise ConfigError(f"{path} nests deeper than JSON is read here (not a file moetrain wrote)") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rng_problem(rng: Any) -> str | None:
    """Why `rng` is not a state `restore_rng_state` can restore (tried on throwaway generators), or None."""
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor) or "python" not in rng:
        return "is not an RNG state (torch and python generators)"
    try:
        torch.Generator().set_state(rng["torch"])
        version, internal, gauss_next = rng["python"]
        random.Random().setstate((version, tuple(internal), gauss_next))
    except (RuntimeError, TypeError, ValueError, OverflowError) as err:
        return f"is not a restorable RNG state ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
    cuda = rng.get("cuda")
    if cuda is not None and not (isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8 and cuda.dim() == 1):
        return "has a CUDA RNG state that is not a 1-d uint8 tensor"
    return None


def _check_trainer_state(state: dict[str, Any], path: Path, step: int,
                         like: tuple[dict[str, Any], dict[str, Any]] | None = None) -> None:
    """Refuse (one line naming the entry) small state of other types than `save_checkpoint` writes.

    The manifest only proves the files are as written by whoever wrote them last: a hand-edited
    trainer.json with a consistent manifest must still end in one line, not deep in the trainer.
    Checked always: step, world size, the per-rank list, a data-loader position and RNG state
    where present. `like` = (trainer state, per-rank state) of the loading trainer: each of their
    keys must be present, with an integer where theirs is one and an object where theirs is one.
    """
    where = path / TRAINER_FILE

    def refuse(what: str) -> ConfigError:
        return ConfigError(f"{where}: {what}; it was not written by moetrain (restore the checkpoint or "
                           "resume from another one)")

    if not _is_int(state.get("step")) or state["step"] != step:
        raise refuse(f"step = {state.get('step')!r:.60} is not the step {step} of its directory")
    world, ranks = state.get("world_size"), state.get("ranks")
    if not _is_int(world) or world < 1 or not isinstance(ranks, list) or len(ranks) != world:
        raise refuse(f"world_size = {world!r:.60} does not match its list of per-rank states")
    top, per_rank = like if like is not None else ({}, {})
    for key, mine in top.items():
        if key not in state or (_is_int(mine) and not _is_int(state[key])):
            raise refuse(f"{key} = {state.get(key)!r:.60} is not {'an integer' if _is_int(mine) else 'present'}")
    for rank, entry in enumerate(ranks):
        if not isinstance(entry, dict):
            raise refuse(f"ranks[{rank}] is not a per-rank state (a JSON object)")
        for key, mine in per_rank.items():
            if key not in entry or (isinstance(mine, dict) and not isinstance(entry[key], dict)):
                raise refuse(f"ranks[{rank}].{key} is missing or not a JSON object")
        loader = entry.get("loader")
        if loader is not None:
            cursor = loader.get("cursor") if isinstance(loader, dict) else None
            if not isinstance(loader, dict) or ("cursor" in loader and not (_is_int(cursor) and cursor >= 0)):
                raise refuse(f"ranks[{rank}].loader.cursor = {cursor!r:.60} is not a position (an integer >= 0)")
        if "rng" in entry:
            problem = _rng_problem(entry["rng"])
            if problem is not None:
                raise refuse(f"ranks[{rank}].rng {problem}")


def _read_trainer_state(path: Path, step: int, like: tuple[dict[str, Any], dict[str, Any]] | None = None
                        ) -> dict[str, Any]:
    tensors_file = path / TRAINER_TENSORS_FILE
    try:
        tensors = safetensors.torch.load_file(tensors_file) if tensors_file.exists() else {}
    except SafetensorError as err:
        raise ConfigError(f"{tensors_file} is not a readable safetensors file: {err}") from None
    state = _read_json(path / TRAINER_FILE)
    if not isinstance(state, dict):
        raise ConfigError(f"{path / TRAINER_FILE} does not hold a JSON object")
    try:
        state = _from_json(state, tensors)
    except (KeyError, TypeError) as err:
        raise ConfigError(f"{path / TRAINER_FILE} refers to tensor {err} that {tensors_file} does not hold") from None
    except RecursionError:
        raise ConfigError(f"{path / TRAINER_FILE} nests deeper than a trainer state does") from None
    _check_trainer_state(state, path, step, like)
    return state


def stored_config(ref: CheckpointRef) -> JobConfig | None:
    """The job config saved with the checkpoint (None for checkpoints saved without one)."""
    ref = _require_verified(ref)
    path = ref.path / CONFIG_FILE
    if not path.exists():
        return None
    stored = _read_json(path)
    if not isinstance(stored, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    try:
        return from_dict(stored)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def check_resume_config(ref: CheckpointRef, job: JobConfig) -> None:
    """Refuse (one line naming the field) a job whose model, data or seed differ from the checkpoint's.

    The same check whatever the world sizes of the writer and the reader: the checkpoint's stored
    config is compared field by field, before the model is built or any tensor is read.
    """
    saved = stored_config(ref)
    if saved is None:
        raise ConfigError(f"checkpoint {ref.path} has no {CONFIG_FILE}: cannot check that this job continues it")
    old, new = _flatten(saved.to_dict()), _flatten(job.to_dict())
    checked = [k for k in sorted(new) if k.startswith("model.")] + \
              [k for k in sorted(new) if k.startswith("data.") or k == "train.seed"]
    for key in checked:
        if key in RESUME_MAY_DIFFER or old.get(key) == new[key]:
            continue
        why = ("the model's architecture cannot change on resume" if key.startswith("model.") else
               "another seed or other data would not continue the same run")
        raise ConfigError(f"{key} = {new[key]!r} differs from {old.get(key)!r} in checkpoint {ref.path} ({why}); "
                          "use the checkpoint's value or another --logging.run_dir")


# ---------------------------------------------------------------------------------------------
# Save and load


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _locally_finite(state: Any) -> bool:
    """True when every floating-point tensor of this rank's part of `state` is finite."""
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
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class _Collectives:
    """The save's collectives on one process group: the default one (None) or a background save's own.

    `moetrain.parallel.collectives` works on the default group, which belongs to the training
    loop's thread; a background save's thread uses a group of its own, so the two threads'
    collectives cannot interleave.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group

    def barrier(self) -> None:
        if self.group is None:
            barrier()
        else:
            dist.barrier(group=self.group)

    def all_gather_objects(self, obj: Any) -> list[Any]:
        if self.group is None:
            return all_gather_objects(obj)
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def all_true(self, flag: bool) -> bool:
        if self.group is None:
            return all_ranks_true(flag)
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        return bool(value.item())


def capture_rng_state() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss_next]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What DCP saves and loads: tensors only (the optimizer's param groups come from the config)."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = {"state": get_optimizer_state_dict(model, optimizer)["state"]}
    return state


@dataclass
class _Snapshot:
    """One save as of the step it was requested at: every value the write needs, none that training changes."""

    root: Path
    step: int
    tensors: dict[str, Any]  # DCP's state: the live tensors (a synchronous save) or their staged copy
    small: Any  # rank 0: trainer.json's JSON (None on other ranks) ...
    small_tensors: dict[str, torch.Tensor]  # ... and copies of the tensors it refers to
    config: dict[str, Any] | None
    meta: dict[str, Any]
    keep_last: int
    protect: tuple[int, ...]
    damaged: tuple[int, ...]


def _snapshot(checkpoint_dir: str | Path, step: int, tensors: dict[str, Any], trainer_state: dict[str, Any],
              per_rank_state: dict[str, Any], keep_last: int, config: dict[str, Any] | None,
              protect: tuple[int, ...], damaged: tuple[int, ...]) -> _Snapshot:
    """Capture the small state now (collective: gathers every rank's `per_rank_state` to rank 0)."""
    ranks_state = all_gather_objects(per_rank_state)
    world = len(ranks_state)
    small, small_tensors = None, {}
    if rank_and_world()[0] == 0:
        # _to_json copies every value (tensors cloned), so later training cannot change what is written.
        small = _to_json({**trainer_state, "step": step, "world_size": world, "ranks": ranks_state}, small_tensors,
                         "trainer")
    # The thread count orders some float sums: a bit-identical resume runs with the same one.
    meta = {"step": step, "world_size": world, "time": time.time(), "intra_op_threads": torch.get_num_threads()}
    return _Snapshot(Path(checkpoint_dir), step, tensors, small, small_tensors,
                     None if config is None else json.loads(json.dumps(config)), meta, keep_last, protect, damaged)


def _write(snap: _Snapshot, comm: _Collectives,
           writer_class: type[HuggingFaceStorageWriter] = HuggingFaceStorageWriter) -> CheckpointRef:
    """Write `snap` as a complete checkpoint, then `prune` (collective on `comm`'s group)."""
    root, step = snap.root, snap.step
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if not comm.all_true(_locally_finite(snap.tensors)):
        raise PoisonedStateError(f"refusing to save step {step}: the model or optimizer state holds NaN/inf")
    rank, world = rank_and_world()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a stale attempt at this same step
        (tmp / TENSORS_DIR).mkdir(parents=True)
    comm.barrier()
    # save_distributed: every rank writes its own shards into its own file (none is gathered).
    writer = writer_class(str(tmp / TENSORS_DIR), save_distributed=True)
    dcp.save(snap.tensors, storage_writer=writer, process_group=comm.group, no_dist=not distributed())
    faults.fail_in_checkpoint_write(step, tmp)
    comm.barrier()
    # Each rank hashes its share of the tensor files; rank 0 writes the manifest.
    tensor_files = [f"{TENSORS_DIR}/{name}" for name in _files_under(tmp / TENSORS_DIR)]
    hashed = comm.all_gather_objects(_manifest_entries(tmp, tensor_files[rank::world]))
    if rank == 0:
        (tmp / TRAINER_FILE).write_text(json.dumps(snap.small))
        if snap.small_tensors:
            safetensors.torch.save_file(snap.small_tensors, tmp / TRAINER_TENSORS_FILE)
        if snap.config is not None:
            (tmp / CONFIG_FILE).write_text(json.dumps(snap.config, indent=2))
        (tmp / META_FILE).write_text(json.dumps(snap.meta))
        entries = {name: entry for part in hashed for name, entry in part.items()}
        small_files = [name for name in _files_under(tmp) if not name.startswith(f"{TENSORS_DIR}/")]
        entries.update(_manifest_entries(tmp, small_files))
        faults.pause_in_checkpoint_write(step, tmp)
        write_durably(tmp / MANIFEST_FILE,
                       json.dumps({"format": FORMAT, "algorithm": "sha256", "files": dict(sorted(entries.items()))},
                                  indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        prune(root, snap.keep_last, step, snap.protect, snap.damaged)
    comm.barrier()
    return CheckpointRef(step, final)


def save_checkpoint(checkpoint_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], per_rank_state: dict[str, Any], keep_last: int,
                    config: dict[str, Any] | None = None, protect: tuple[int, ...] = (),
                    damaged: tuple[int, ...] = ()) -> CheckpointRef:
    """Write a complete checkpoint for `step` (collective: every rank calls it), then `prune`.

    `trainer_state` must be the same on every rank; `per_rank_state` (loader position,
    RNG states: JSON values and tensors) is gathered from every rank and stored as a list
    indexed by rank. `config` (the job's config as a dict) is stored for `check_resume_config`;
    `protect`: steps `prune` must keep (the checkpoint the run resumed from); `damaged`: steps known
    to fail their manifest, which `prune` deletes first.
    """
    snap = _snapshot(checkpoint_dir, step, _tensor_state(model, optimizer), trainer_state, per_rank_state,
                     keep_last, config, protect, damaged)
    with _quiet_single_process():
        return _write(snap, _Collectives())


_SAFETENSORS_DTYPES = {dtype: name for name, dtype in safetensors.torch._TYPES.items()}


class _UnblockingSafetensorsWriter(HuggingFaceStorageWriter):
    """DCP's safetensors writer (one file per rank, the same name, header and tensor bytes) whose write lets other
    threads run.

    DCP's writer has `safetensors.torch.save` build the whole file as one bytes object, which holds
    the GIL for the whole copy (about 0.76 s per 240 MB measured alone): from a background thread,
    that stops the training loop. Here the header is built as safetensors builds it and each
    tensor is written from its own memory; a file write releases the GIL. Used by background saves;
    the files are compared with DCP's own by tests/unit/test_checkpoint_async.py.
    """

    def write_data(self, plan, planner) -> Future:
        if any(item.type == WriteItemType.BYTE_IO for item in plan.items):
            raise TypeError("a checkpoint's DCP state holds tensors only")  # what _tensor_state builds
        futures: Future = Future()
        if not plan.items:
            futures.set_result([])
            return futures
        file_name = _gen_file_name(1, 1, plan.storage_data.get("shard_index"))
        tensors = [(item, planner.resolve_data(item).detach().contiguous()) for item in plan.items]
        header: dict[str, Any] = {}
        offset = 0
        for item, tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            header[item.index.fqn] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                                      "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        sharding = {item.index.fqn: {"saved_offsets": list(item.tensor_data.chunk.offsets)} for item, _ in tensors}
        header["__metadata__"] = {DCP_SHARDING_KEY: json.dumps(sharding), DCP_VERSION_KEY: str(HF_DCP_VERSION),
                                  FORMAT_KEY: FORMAT_VALUE}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes
        results = []
        with open(Path(self.path) / file_name, "wb") as stream:
            stream.write(len(encoded).to_bytes(8, "little"))
            stream.write(encoded)
            for item, tensor in tensors:
                nbytes = tensor.numel() * tensor.element_size()
                results.append(WriteResult(index=item.index, size_in_bytes=nbytes,
                                           storage_data=_StorageInfo(file_name, stream.tell(), nbytes)))
                stream.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            stream.flush()
            os.fsync(stream.fileno())
        futures.set_result(results)
        return futures


class _BackgroundSave:
    """One save in flight: `_write` of a staged snapshot in a thread; `wait` returns its checkpoint or raises."""

    def __init__(self, snap: _Snapshot, comm: _Collectives):
        self.step = snap.step
        self.started = time.monotonic()
        self.finished: float | None = None
        self._result: CheckpointRef | None = None
        self._error: BaseException | None = None
        # A daemon thread: a process that dies or exits on an error does not wait for a write whose
        # checkpoint was never renamed, and what it leaves is a `.tmp-*` directory, never read.
        self._thread = threading.Thread(target=self._run, args=(snap, comm), daemon=True,
                                        name=f"moetrain-checkpoint-{snap.step}")
        self._thread.start()

    def _run(self, snap: _Snapshot, comm: _Collectives) -> None:
        try:
            self._result = _write(snap, comm, _UnblockingSafetensorsWriter)
        except BaseException as err:  # DCP's CheckpointException derives from BaseException
            self._error = err
        finally:
            self.finished = time.monotonic()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def failed(self) -> BaseException | None:
        return self._error if self.done() else None

    def wait(self) -> CheckpointRef:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def prune(checkpoint_dir: str | Path, keep_last: int, written: int, protect: tuple[int, ...] = (),
          damaged: tuple[int, ...] = ()) -> list[int]:
    """Delete checkpoints beyond `keep_last` after step `written` was saved; return the deleted steps.

    Never deleted: `written` and `protect` (the checkpoint the run resumed from). Deleted first:
    the `damaged` ones and every checkpoint newer than `written`: a run only writes a step below an
    existing one after its resume skipped that one as damaged (it resumes from the newest intact
    one), so those are known-damaged or of a history the run has left; counting them, as a prune
    by step number would, can leave only damaged checkpoints. Of the other, older ones the newest
    `keep_last - 1` stay (the protected one counts among them when it is one of them).
    """
    refs = list_complete(checkpoint_dir)
    kept = {written, *protect}
    bad = [r for r in refs if (r.step > written or r.step in damaged) and r.step not in kept]
    older = [r for r in refs if r.step < written and r not in bad]
    keep_older = {r.step for r in older[max(0, len(older) - (keep_last - 1)):]} if keep_last > 1 else set()
    doomed = bad + [r for r in older if r.step not in keep_older and r.step not in kept]
    for ref in doomed:
        shutil.rmtree(ref.path, ignore_errors=True)
    return [r.step for r in doomed]


def _check_tensor_headers(ref: CheckpointRef) -> None:
    """Parse each tensor file's header as DCP's reader will, refusing in one line what it would fail on.

    DCP logs a reader's failure with its traceback (on the root logger) before raising, so a
    damaged header must be caught here: a readable safetensors header whose sharding entry, when
    present, gives every tensor a list of non-negative integer offsets, one per dimension.
    """
    for file in sorted((ref.path / TENSORS_DIR).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                shapes = {key: handle.get_slice(key).get_shape() for key in handle.keys()}
                sharding = (handle.metadata() or {}).get(DCP_SHARDING_KEY)
        except (SafetensorError, OSError) as err:
            raise ConfigError(f"{file} is not a readable safetensors file: {str(err).splitlines()[0]}") from None
        if sharding is None:
            continue
        try:
            entries = json.loads(sharding)
        except (json.JSONDecodeError, RecursionError):
            entries = None
        for key, shape in shapes.items():
            offsets = entries.get(key) if isinstance(entries, dict) else None
            offsets = offsets.get("saved_offsets") if isinstance(offsets, dict) else None
            if not (isinstance(offsets, list) and len(offsets) == len(shape)
                    and all(_is_int(o) and o >= 0 for o in offsets)):
                raise ConfigError(f"{file}: the {DCP_SHARDING_KEY} entry of tensor {key!r} in its header is not "
                                  f"{len(shape)} offsets >= 0; the checkpoint was not written by moetrain")


def _load_tensors(ref: CheckpointRef, state: dict[str, Any]) -> None:
    _check_tensor_headers(ref)
    reader = HuggingFaceStorageReader(str(ref.path / TENSORS_DIR))
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=reader, no_dist=not distributed())
    except (CheckpointException, SafetensorError) as err:  # DCP's wrapper of a rank's failure; a bad header
        first = str(err).strip().splitlines()
        raise ConfigError(f"checkpoint {ref.path} cannot be loaded into this model: "
                          f"{first[-1] if first else type(err).__name__}") from None


def saved_intra_op_threads(ref: CheckpointRef) -> int | None:
    """The intra-op thread count the run that wrote `ref` trained with (None for checkpoints without it)."""
    meta = _read_json(ref.path / META_FILE)
    if not isinstance(meta, dict):
        raise ConfigError(f"{ref.path / META_FILE} does not hold a JSON object")
    value = meta.get("intra_op_threads")
    return value if _is_int(value) and value > 0 else None


def load_checkpoint(ref: CheckpointRef, model: nn.Module, optimizer: torch.optim.Optimizer,
                    like: tuple[dict[str, Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Verify, then restore model and optimizer in place (resharding as needed); return the trainer state.

    `like`: the loading trainer's (trainer_state(), per_rank_state()), whose keys and integer
    fields the saved state must have (`_check_trainer_state`), checked before any tensor is read.
    """
    ref = _require_verified(ref)
    trainer_state = _read_trainer_state(ref.path, ref.step, like)
    state = _tensor_state(model, optimizer)
    param_groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
    _load_tensors(ref, state)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, {"state": state["optimizer"]["state"], "param_groups": param_groups})
    return trainer_state


def load_model_weights(ref: CheckpointRef, model: nn.Module) -> dict[str, Any]:
    """Verify, then restore only the model (e.g. for sampling in one process); return the trainer state."""
    ref = _require_verified(ref)
    trainer_state = _read_trainer_state(ref.path, ref.step)
    state = _tensor_state(model, None)
    _load_tensors(ref, state)
    set_model_state_dict(model, state["model"])
    return trainer_state


class CheckpointState(Protocol):
    """What a checkpoint holds of a trainer: model, optimizer, config and the small state beside them."""

    cfg: JobConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def trainer_state(self) -> dict[str, Any]: ...

    def per_rank_state(self) -> dict[str, Any]: ...


class Checkpointer:
    """When a run saves and where it resumes: a run directory's `checkpoints/` under `CheckpointConfig`."""

    def __init__(self, checkpoint_dir: Path, cfg: CheckpointConfig, last_step: int, run_dir_name: str,
                 collective_timeout_s: float | None = None):
        self.dir = Path(checkpoint_dir)
        self.cfg = cfg
        self.last_step = last_step
        self.run_dir_name = run_dir_name
        self.resumed_from: int | None = None  # never pruned while this run saves
        self.damaged: tuple[int, ...] = ()  # newer than the resume point: each failed its manifest
        # Asynchronous saves: the background group's timeout (a lost peer ends a background save
        # as it ends a step), the save in flight, the stager whose host buffers later saves reuse.
        self.collective_timeout_s = collective_timeout_s
        self._in_flight: _BackgroundSave | None = None
        self._failure_logged = False
        self._stager: DefaultStager | None = None
        self._group: _Collectives | None = None

    def resume_point(self, job: JobConfig | None = None) -> CheckpointRef | None:
        """The checkpoint to resume from (verified, and its config checked against `job`), or None.

        resume = false refuses a run directory that has checkpoints, true requires one, "auto"
        starts fresh when there is none. A damaged newest checkpoint is skipped with one warning
        line naming the file; with none intact the run stops (ConfigError). Collective.
        """
        existing = list_complete(self.dir)
        if not existing:
            if self.cfg.resume is True:
                raise ConfigError(f"checkpoint.resume = true but logging.run_dir = {self.run_dir_name!r} has no "
                                  "checkpoint; use --checkpoint.resume auto to start fresh when there is none")
            return None
        if self.cfg.resume is False:
            raise ConfigError(f"logging.run_dir = {self.run_dir_name!r} already has checkpoints (newest: step "
                              f"{existing[-1].step}); pass --checkpoint.resume True (or auto) to continue it, or "
                              "choose another --logging.run_dir")
        ref, skipped = newest_intact(self.dir)
        if ref is None:
            raise ConfigError(f"no intact checkpoint to resume from under {self.dir}: {skipped[0]}")
        self.resumed_from = ref.step
        self.damaged = tuple(r.step for r in existing if r.step > ref.step)
        if rank_and_world()[0] == 0:
            for problem in skipped:
                log.warning("skipping a damaged checkpoint: %s; resuming from %s", problem, ref.path.name)
        if job is not None:
            check_resume_config(ref, job)
        return ref

    def due(self, step: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.every == 0 or step == self.last_step)

    def maybe_save(self, step: int, state: CheckpointState, force: bool = False) -> CheckpointRef | None:
        """Save `state` as step `step` when one is due or `force`d (collective: every rank calls it).

        With `checkpoint.async_save` it returns once the state is captured, with the reference the
        checkpoint will have when complete (`wait` says when it is); a save still in flight is
        waited for first, and its failure is raised here.
        """
        faults.crash_after_step(step, rank_and_world()[0])
        self._log_background_failure()
        if not (force or self.due(step)):
            return None
        self.wait()
        protect = () if self.resumed_from is None else (self.resumed_from,)
        if not self.cfg.async_save:
            try:
                saved = save_checkpoint(self.dir, step, state.model, state.optimizer, state.trainer_state(),
                                        state.per_rank_state(), self.cfg.keep_last, state.cfg.to_dict(),
                                        protect=protect, damaged=self.damaged)
            except PoisonedStateError as err:
                raise TrainingDiverged(str(err)) from None
            self.damaged = ()  # pruned, or (the step just written) replaced by an intact one
            return saved
        snap = _snapshot(self.dir, step, {}, state.trainer_state(), state.per_rank_state(), self.cfg.keep_last,
                         state.cfg.to_dict(), protect, self.damaged)
        snap.tensors = self._staged(_tensor_state(state.model, state.optimizer))
        self._in_flight = _BackgroundSave(snap, self._background_group())
        return CheckpointRef(step, self.dir / step_dir_name(step))

    def wait(self) -> CheckpointRef | None:
        """Block until the save in flight (if any) is complete and return it; its failure is raised here.

        Collective in effect: every rank's background save takes part in the same collectives.
        """
        pending, self._in_flight = self._in_flight, None
        self._failure_logged = False
        if pending is None:
            return None
        try:
            saved = pending.wait()
        except PoisonedStateError as err:
            raise TrainingDiverged(str(err)) from None
        self.damaged = ()
        if rank_and_world()[0] == 0 and pending.finished is not None:
            log.info("checkpoint saved: %s (written in the background in %.2f s)", saved.path,
                     pending.finished - pending.started)
        return saved

    def close(self, raise_errors: bool = True) -> None:
        """Wait for the save in flight and release the staging buffers; `raise_errors=False` only logs a failure.

        The run calls it before it lets go of the run directory and the process group: a save in
        flight completes (or fails) first. On a path that is already failing, the background
        save's failure is logged and the run's own error stays the one raised.
        """
        try:
            self.wait()
        except BaseException as err:  # DCP's CheckpointException derives from BaseException
            if raise_errors:
                raise
            log.error("the checkpoint being written in the background failed too: %s",
                      str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _staged(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """A copy of `tensors` in host memory (DTensors stay DTensors), into buffers kept for the next save."""
        if self._stager is None:
            # Synchronous staging (the copy is what the loop pays for) into kept buffers, pinned where
            # a GPU copies into them; shared memory is only for DCP's process-based checkpointer.
            pinned = torch.cuda.is_available() and torch.cuda.is_initialized()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))
        staged = self._stager.stage(tensors)
        assert isinstance(staged, dict)
        return staged

    def _background_group(self) -> _Collectives:
        """The background save's own process group (gloo, created once, collectively, on first use)."""
        if self._group is None:
            group = None
            if distributed() and dist.get_world_size() > 1:
                timeout = None if self.collective_timeout_s is None else timedelta(seconds=self.collective_timeout_s)
                group = dist.new_group(backend="gloo", timeout=timeout)
            else:
                _ignore_single_process_warning()
            self._group = _Collectives(group)
        return self._group

    def _log_background_failure(self) -> None:
        # Said at once; raised on every rank at the next save or the end of the run, where every rank waits.
        error = None if self._in_flight is None else self._in_flight.failed()
        if error is not None and not self._failure_logged and rank_and_world()[0] == 0:
            self._failure_logged = True
            log.error("the background checkpoint of step %d failed (raised at the next save or the run's end): %s",
                      self._in_flight.step, str(error).strip().splitlines()[0] if str(error).strip() else
                      type(error).__name__)

    def latest(self) -> CheckpointRef | None:
        return latest_complete(self.dir)
