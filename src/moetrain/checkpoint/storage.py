"""Writing and reading a whole checkpoint: the model and optimizer tensors through DCP, then the small files.

The tensors are `tensors/*.safetensors`, written through torch.distributed.checkpoint (DCP) with
its safetensors storage. Sharded tensors stay sharded: each rank writes one file with its own
shards and their offsets (in the file's JSON header), and on load DCP reads, from every file, the
pieces that the loading rank's shards need, so a checkpoint reshards to any mesh, world size and
expert-parallel layout. Optimizer hyperparameters (param groups) are not stored: they come from
the config, and the learning rate is set by the schedule every step. Beside them: `trainer.json`
(`moetrain.checkpoint.state`), `config.json`, `meta.json` (step, world size, time, thread count)
and `manifest.json` (`moetrain.checkpoint.manifest`), written last.

Atomicity: all ranks write into `checkpoints/.tmp-step_00000100/`; only when every rank has
finished does rank 0 add the state, config, meta and manifest files and rename the directory to
its final name. A rename within one directory is atomic, so a `step_*` directory is always
complete; a run killed mid-write leaves only a `.tmp-*` directory, which is never read and is
deleted by the next save or resume. Before writing, the model and optimizer state are checked to
be finite on every rank, so a diverged run cannot leave a poisoned checkpoint.

A background save (`BackgroundSave`) is the same `_write` of a snapshot whose tensors were staged
in host memory, in a thread of its own whose collectives run on a process group of their own
(gloo, what DCP's `async_save` requires too): a group orders its collectives by call, and the
training loop's collectives on the default group would interleave with the save's. This is DCP's
thread-based `async_save` (stage, then `save` in a thread) with the completion steps in the same
thread, and one change: the tensor files are written by `_UnblockingSafetensorsWriter` (the files
of DCP's safetensors writer, written tensor by tensor) because DCP's writer serializes a whole
file in one call that holds the GIL, stopping the training loop for as long.

Loading reads nothing before the manifest has verified every file, and nothing is unpickled; a
`meta.json` that is not a JSON object is one ConfigError line. Test
hooks (`moetrain.runtime.faults`) pause inside a write or fail a write on request. This module
must not decide when to save or where to resume (`moetrain.checkpoint.checkpointer` does).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from moetrain.checkpoint.layout import (
    CONFIG_FILE,
    META_FILE,
    TENSORS_DIR,
    CheckpointRef,
    prune,
    step_dir_name,
)
from moetrain.checkpoint.manifest import files_under, manifest_entries, require_verified, write_manifest
from moetrain.checkpoint.state import is_int, read_json, read_trainer_state, to_json, write_trainer_state
from moetrain.durable import fsync_dir
from moetrain.errors import ConfigError, PoisonedStateError
from moetrain.parallel.collectives import all_gather_objects, all_ranks_true, barrier, multi_rank, rank_and_world
from moetrain.runtime import faults

DCP_SHARDING_KEY = "DCP_SHARDING_INFO"  # a tensor file's header metadata: each tensor's offsets in the whole


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every single-process save/load that it assumes one process; that is
    # exactly the intent here, so the warning is noise.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def ignore_single_process_warning() -> None:
    """Silence DCP's one-process warning for good (what `_quiet_single_process` does for one call)."""
    # For background saves in one process: `warnings.catch_warnings` swaps the process-wide filters
    # and is not safe from two threads, so the filter of `_quiet_single_process` is installed once.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")


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


def _state_options(model: nn.Module) -> StateDictOptions:
    # A model with frozen parameters (LoRA: the base) saves and restores only what trains and the buffers;
    # the frozen weights come from model.init_from again, whose identity checkpoint/lora_base.py checks.
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What DCP saves and loads: tensors only (the optimizer's param groups come from the config)."""
    state: dict[str, Any] = {"model": get_model_state_dict(model, options=_state_options(model))}
    if optimizer is not None:
        state["optimizer"] = {"state": get_optimizer_state_dict(model, optimizer)["state"]}
    return state


@dataclass
class Snapshot:
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


def snapshot(checkpoint_dir: str | Path, step: int, tensors: dict[str, Any], trainer_state: dict[str, Any],
             per_rank_state: dict[str, Any], keep_last: int, config: dict[str, Any] | None,
             protect: tuple[int, ...], damaged: tuple[int, ...]) -> Snapshot:
    """Capture the small state now (collective: gathers every rank's `per_rank_state` to rank 0)."""
    ranks_state = all_gather_objects(per_rank_state)
    world = len(ranks_state)
    small, small_tensors = None, {}
    if rank_and_world()[0] == 0:
        # to_json copies every value (tensors cloned), so later training cannot change what is written.
        small = to_json({**trainer_state, "step": step, "world_size": world, "ranks": ranks_state}, small_tensors,
                        "trainer")
    # The thread count orders some float sums: a bit-identical resume runs with the same one.
    meta = {"step": step, "world_size": world, "time": time.time(), "intra_op_threads": torch.get_num_threads()}
    return Snapshot(Path(checkpoint_dir), step, tensors, small, small_tensors,
                    None if config is None else json.loads(json.dumps(config)), meta, keep_last, protect, damaged)


def _write(snap: Snapshot, group: dist.ProcessGroup | None = None,
           writer_class: type[HuggingFaceStorageWriter] = HuggingFaceStorageWriter) -> CheckpointRef:
    """Write `snap` as a complete checkpoint, then `prune` (collective on `group`, by default the default one)."""
    root, step = snap.root, snap.step
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if not all_ranks_true(_locally_finite(snap.tensors), group):
        raise PoisonedStateError(f"refusing to save step {step}: the model or optimizer state holds NaN/inf")
    rank, world = rank_and_world()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a stale attempt at this same step
        (tmp / TENSORS_DIR).mkdir(parents=True)
    barrier(group)
    # save_distributed: every rank writes its own shards into its own file (none is gathered).
    writer = writer_class(str(tmp / TENSORS_DIR), save_distributed=True)
    dcp.save(snap.tensors, storage_writer=writer, process_group=group, no_dist=not multi_rank())
    faults.fail_in_checkpoint_write(step, tmp)
    barrier(group)
    # Each rank hashes its share of the tensor files; rank 0 writes the manifest.
    tensor_files = [f"{TENSORS_DIR}/{name}" for name in files_under(tmp / TENSORS_DIR)]
    hashed = all_gather_objects(manifest_entries(tmp, tensor_files[rank::world]), group)
    if rank == 0:
        write_trainer_state(tmp, snap.small, snap.small_tensors)
        if snap.config is not None:
            (tmp / CONFIG_FILE).write_text(json.dumps(snap.config, indent=2))
        (tmp / META_FILE).write_text(json.dumps(snap.meta))
        entries = {name: entry for part in hashed for name, entry in part.items()}
        small_files = [name for name in files_under(tmp) if not name.startswith(f"{TENSORS_DIR}/")]
        entries.update(manifest_entries(tmp, small_files))
        faults.pause_in_checkpoint_write(step, tmp)
        write_manifest(tmp, entries)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        prune(root, snap.keep_last, step, snap.protect, snap.damaged)
    barrier(group)
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
    snap = snapshot(checkpoint_dir, step, tensor_state(model, optimizer), trainer_state, per_rank_state,
                    keep_last, config, protect, damaged)
    with _quiet_single_process():
        return _write(snap)


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
            raise TypeError("a checkpoint's DCP state holds tensors only")  # what tensor_state builds
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


class BackgroundSave:
    """One save in flight: `_write` of a staged snapshot in a thread; `wait` returns its checkpoint or raises."""

    def __init__(self, snap: Snapshot, group: dist.ProcessGroup | None):
        self.step = snap.step
        self.started = time.monotonic()
        self.finished: float | None = None
        self._result: CheckpointRef | None = None
        self._error: BaseException | None = None
        # A daemon thread: a process that dies or exits on an error does not wait for a write whose
        # checkpoint was never renamed, and what it leaves is a `.tmp-*` directory, never read.
        self._thread = threading.Thread(target=self._run, args=(snap, group), daemon=True,
                                        name=f"moetrain-checkpoint-{snap.step}")
        self._thread.start()

    def _run(self, snap: Snapshot, group: dist.ProcessGroup | None) -> None:
        try:
            self._result = _write(snap, group, _UnblockingSafetensorsWriter)
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
                    and all(is_int(o) and o >= 0 for o in offsets)):
                raise ConfigError(f"{file}: the {DCP_SHARDING_KEY} entry of tensor {key!r} in its header is not "
                                  f"{len(shape)} offsets >= 0; the checkpoint was not written by moetrain")


def _load_tensors(ref: CheckpointRef, state: dict[str, Any]) -> None:
    _check_tensor_headers(ref)
    reader = HuggingFaceStorageReader(str(ref.path / TENSORS_DIR))
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=reader, no_dist=not multi_rank())
    except (CheckpointException, SafetensorError) as err:  # DCP's wrapper of a rank's failure; a bad header
        first = str(err).strip().splitlines()
        raise ConfigError(f"checkpoint {ref.path} cannot be loaded into this model: "
                          f"{first[-1] if first else type(err).__name__}") from None


def saved_intra_op_threads(ref: CheckpointRef) -> int | None:
    """The intra-op thread count the run that wrote `ref` trained with (None for checkpoints without it)."""
    meta = read_json(ref.path / META_FILE)
    if not isinstance(meta, dict):
        raise ConfigError(f"{ref.path / META_FILE} does not hold a JSON object")
    value = meta.get("intra_op_threads")
    return value if is_int(value) and value > 0 else None


def load_checkpoint(ref: CheckpointRef, model: nn.Module, optimizer: torch.optim.Optimizer,
                    like: tuple[dict[str, Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Verify, then restore model and optimizer in place (resharding as needed); return the trainer state.

    `like`: the loading trainer's (trainer_state(), per_rank_state()), whose keys and integer
    fields the saved state must have (`read_trainer_state`), checked before any tensor is read.
    """
    ref = require_verified(ref)
    trainer_state = read_trainer_state(ref.path, ref.step, like)
    state = tensor_state(model, optimizer)
    param_groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
    _load_tensors(ref, state)
    set_model_state_dict(model, state["model"], options=_state_options(model))
    set_optimizer_state_dict(model, optimizer, {"state": state["optimizer"]["state"], "param_groups": param_groups})
    return trainer_state


def load_model_weights(ref: CheckpointRef, model: nn.Module) -> dict[str, Any]:
    """Verify, then restore only the model (e.g. for sampling in one process); return the trainer state."""
    ref = require_verified(ref)
    trainer_state = read_trainer_state(ref.path, ref.step)
    state = tensor_state(model, None)
    _load_tensors(ref, state)
    set_model_state_dict(model, state["model"], options=_state_options(model))
    return trainer_state
