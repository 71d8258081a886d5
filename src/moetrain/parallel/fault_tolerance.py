"""Fault-tolerant HSDP with torchft: the replicate dimension as a managed group of replica groups.

Each replica group is its own job (its own process group, FSDP/EP inside it, its own run
directory). `ReplicaGroup.join` starts a torchft `Manager` for it: every step the group asks the
lighthouse for a quorum (`begin_step`), so a lost group drops out and a restarted one comes back;
the groups then meet in torchft's managed gloo group, rank i of each group with rank i of the
others (the groups shard identically, so their local gradient shards line up):

- `exchange(values)`: the step's small vector summed over the participating groups (the valid
  token count that divides the loss, and checks: a replica id used twice, another config or
  code version).
- `sync_gradients(model)`: every local gradient shard summed over the groups (flattened in
  buckets). When is `parallel.sync_policy`'s, resolved as plain HSDP with ft.replica_groups
  replicas resolves it (`managed_sync_policy`): once per step after the last microbatch's backward
  (delayed_all_reduce, final_only; "auto" with train.grad_accum > 1), or after every microbatch's
  (every_microbatch: `accumulation` sums each microbatch's gradient alone, then adds it to those
  of the earlier microbatches, as FSDP does). The loss is already divided by the participating
  groups' token count, so a SUM is exact.
- `commit()`: torchft's vote; a step is applied only when every participating group got through
  its all-reduces (a group lost mid-step makes the others redo the step without it).

A restarted group recovers from a live peer, not from a checkpoint: torchft's quorum names a
source group, whose rank i serves `recovery_state` (local parameter and optimizer shards, buffers
such as the aux-free expert bias, and the trainer's counters and data position) over HTTP, and
the rejoining rank i loads it (`load_recovery_state`) before taking the same step as the others.
The transfer is read back with `torch.load(weights_only=True)`: tensors and plain containers
only, nothing executed. This module moves gradients and state between groups; it must not
compute losses, step optimizers, or decide when to save.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from moetrain import __version__
from moetrain.config.ft import FtConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.errors import ConfigError
from moetrain.parallel.collectives import all_gather_floats, all_ranks_true
from moetrain.parallel.grad_sync import SyncPolicy, resolve_sync_policy
from moetrain.parallel.mesh import JobMesh, MeshDims

_BUCKET_ELEMENTS = 1 << 24  # gradients are summed across groups in flat buckets of at most this many elements
_FINGERPRINT_PIECES = 3  # 20-bit pieces of the config/code fingerprint, exact in float64 even when squared


class ReplicaGroupLost(RuntimeError):
    """The lighthouse or the quorum could not be reached; the message (one line) says what and at which step."""


def _weights_only_transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, reading what a peer sends without unpickling code."""
    from torchft.checkpointing._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as stream:
                return _streaming_load(stream, weights_only=True)

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


def data_position(ft: FtConfig, group_rank: int, group_world: int) -> tuple[int, int]:
    """(rank, world) of this rank among all groups' data ranks: group g's ranks read the g-th share of each step.

    The data order is then a function of the step and the group alone; the share of a group that is
    down is skipped (no other group reads it), and a rejoined group reads its own share again from the
    step it rejoins at. With every group up this is plain HSDP's split (replicate-major).
    """
    return ft.replica_id * group_world + group_rank, ft.replica_groups * group_world


def managed_sync_policy(parallel: ParallelConfig, dims: MeshDims, grad_accum: int, ft: FtConfig) -> SyncPolicy:
    """When the managed all-reduce runs: `parallel.sync_policy` resolved as for plain HSDP whose replicate
    dimension is the ft.replica_groups groups (so "auto" is delayed_all_reduce when gradients accumulate)."""
    return resolve_sync_policy(parallel, replace(dims, dp_replicate=ft.replica_groups), grad_accum)


def job_fingerprint(sections: dict[str, Any]) -> str:
    """A hash of what every replica group must share (the config sections given, and the code version)."""
    text = json.dumps({"moetrain": __version__, **sections}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _fingerprint_pieces(fingerprint: str) -> list[float]:
    value = int(fingerprint[:15], 16)  # 60 bits
    return [float((value >> (20 * i)) & 0xFFFFF) for i in range(_FINGERPRINT_PIECES)]


def parameter_checksum(model: nn.Module) -> str:
    """A hash of the group's full parameters and buffers, the same on every rank of the group (collective).

    Each rank hashes its local shards' bytes in name order; the ranks' digests, gathered in rank
    order, are hashed again. Groups that shard alike and hold bitwise-equal state get equal checksums.
    """
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        digest.update(name.encode())
        digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    head = int.from_bytes(digest.digest()[:6], "big")  # 48 bits: exact as a float64
    ranks = all_gather_floats([float(head)])
    return hashlib.sha256(",".join(str(int(r[0])) for r in ranks).encode()).hexdigest()[:16]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def recovery_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's model and optimizer state as local tensors and plain containers (what a peer sends)."""
    optim = optimizer.state_dict()
    return {
        "model": {name: _local(t).detach() for name, t in model.state_dict().items()},
        "optimizer": {"state": {int(k): {key: _local(v) if isinstance(v, torch.Tensor) else v
                                         for key, v in s.items()} for k, s in optim["state"].items()},
                      "param_groups": optim["param_groups"]},
    }


@torch.no_grad()
def load_recovery_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Copy a peer rank's `recovery_state` into this rank's model and optimizer (same sharding)."""
    ours = model.state_dict()
    if set(ours) != set(state["model"]):
        raise ConfigError("the live replica group's model has other parameters than this one's: "
                          "start every group with the same config")
    for name, tensor in ours.items():
        _local(tensor).copy_(state["model"][name])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    rebuilt: dict[int, dict[str, Any]] = {}
    for index, entries in state["optimizer"]["state"].items():
        param = params[int(index)]
        rebuilt[int(index)] = {
            key: (DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                     shape=param.shape, stride=param.stride())
                  if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0 else value)
            for key, value in entries.items()}
    optimizer.load_state_dict({"state": rebuilt, "param_groups": state["optimizer"]["param_groups"]})


class ReplicaGroup:
    """This replica group's membership in the fault-tolerant run (a torchft Manager); see the module docstring."""

    def __init__(self, ft: FtConfig, manager: Any, fingerprint: str, policy: SyncPolicy):
        self.ft = ft
        self.manager = manager
        self.fingerprint = fingerprint
        self.policy = policy  # when gradients cross groups (`managed_sync_policy`)
        self.participants: list[int] = []  # replica ids in the current step's quorum
        self._first_step = True

    @classmethod
    def join(cls, ft: FtConfig, job: JobMesh, fingerprint: str, state: Callable[[], dict[str, Any]],
             load_state: Callable[[dict[str, Any]], None], policy: SyncPolicy) -> ReplicaGroup:
        """Start this group's manager (collective within the group: every rank calls it).

        `state`/`load_state` give and take what a rejoining group copies from a live one; `policy`
        says when gradients are summed over the groups (`managed_sync_policy`).
        """
        timeout = timedelta(seconds=ft.timeout_s)
        try:
            manager = cls._manager(ft, job, timeout, state, load_state)
        except RuntimeError as err:  # the rank-0 manager server could not reach the lighthouse
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise ConfigError(f"ft.lighthouse = {ft.lighthouse!r} is unreachable (within ft.connect_timeout_s = "
                              f"{ft.connect_timeout_s:g} s): start `moetrain lighthouse` first ({first})") from None
        return cls(ft, manager, fingerprint, policy)

    @staticmethod
    def _manager(ft: FtConfig, job: JobMesh, timeout: timedelta, state: Callable[[], dict[str, Any]],
                 load_state: Callable[[dict[str, Any]], None]) -> Any:
        """torchft's Manager for this group (the `ft` extra: `pip install 'moetrain[ft]'`)."""
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError:
            raise ConfigError("ft.enabled = true needs torchft: pip install 'moetrain[ft]'") from None
        return Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state, state_dict=state,
            min_replica_size=ft.min_replicas, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timedelta(seconds=ft.connect_timeout_s), rank=job.rank, world_size=job.world,
            lighthouse_addr=ft.lighthouse, replica_id=f"moetrain_group_{ft.replica_id}",
            checkpoint_transport=_weights_only_transport(timeout),
            init_sync=False)  # every group initialises from the same seed: nothing to copy at step 0

    def set_step(self, step: int) -> None:
        """Tell the manager the step a resumed run starts from (its quorum compares steps to pick a source)."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin_step(self, step: int) -> None:
        """Ask for this step's quorum; a rejoining group loads a live peer's state here (`load_state`).

        The first step this process takes (of a fresh or a resumed run) waits up to ft.quorum_timeout_s
        for all ft.replica_groups, so that groups started together step together from the start
        rather than the first one alone (a group joining a live run finds them at once).
        """
        deadline = time.monotonic() + self.ft.quorum_timeout_s
        try:
            self.manager.start_quorum()
            while self._first_step and all_ranks_true(
                    time.monotonic() < deadline and self.manager.num_participants() < self.ft.replica_groups):
                time.sleep(0.2)
                self.manager.start_quorum()
            self._first_step = False
        except ConfigError:
            raise
        except Exception as err:  # torchft raises RuntimeError/TimeoutError from its RPCs
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            first = first.split(", details:")[0]  # the RPC status without its metadata dump
            raise ReplicaGroupLost(f"replica group {self.ft.replica_id}: no quorum from the lighthouse "
                                   f"{self.ft.lighthouse} before step {step + 1} ({first[:200]})") from None

    def exchange(self, values: list[float]) -> list[float]:
        """`values` summed over the participating groups, with the step's checks (one small all-reduce).

        Also fills `participants`; raises ConfigError when two live groups share a replica id or run
        another config or code version. After a failed all-reduce (a group lost mid-step) it returns
        zeros, and `commit()` then refuses the step.
        """
        n = self.ft.replica_groups
        member = [1.0 if i == self.ft.replica_id else 0.0 for i in range(n)]
        pieces = _fingerprint_pieces(self.fingerprint)
        vector = torch.tensor(values + member + pieces + [p * p for p in pieces], dtype=torch.float64)
        self.manager.allreduce(vector, reduce_op=_SUM).wait()
        if self.manager.errored() is not None:
            self.participants = []
            return [0.0] * len(values)
        out = vector.tolist()
        summed, counts = out[:len(values)], out[len(values):len(values) + n]
        sums, squares = out[len(values) + n:len(values) + n + len(pieces)], out[len(values) + n + len(pieces):]
        groups = round(sum(counts))
        for replica_id, count in enumerate(counts):
            if count > 1.5:
                raise ConfigError(f"ft.replica_id = {replica_id} is used by {round(count)} live replica groups: "
                                  "give each group its own id")
        if any(abs(s * s - groups * q) > 0.5 for s, q in zip(sums, squares, strict=True)):
            raise ConfigError("the live replica groups run different configs or moetrain versions (their "
                              "fingerprints differ): start every group from the same job and code")
        self.participants = [i for i, count in enumerate(counts) if count > 0.5]
        return summed

    def sync_gradients(self, model: nn.Module) -> None:
        """Sum every local gradient shard over the participating groups, in place.

        The groups' buckets line up: each layer's experts are one stacked tensor, so a parameter has a
        gradient in every group or (unused by the model) in none.
        """
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            start = 0
            while start < len(same):
                bucket, size = [], 0
                while start < len(same) and (not bucket or size + same[start].numel() <= _BUCKET_ELEMENTS):
                    bucket.append(same[start])
                    size += same[start].numel()
                    start += 1
                flat = torch.cat([g.reshape(-1) for g in bucket])
                self.manager.allreduce(flat, reduce_op=_SUM).wait()
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()

    def accumulation(self, model: nn.Module, steps: Iterator[tuple[Any, bool]]) -> Iterator[tuple[Any, bool]]:
        """Wrap `grad_sync.accumulation`'s (microbatch, is_last) pairs: under every_microbatch, each
        microbatch's gradient is summed over the groups right after its backward (the loop body), alone,
        then added to the earlier microbatches' sum (`earlier += new`, FSDP's own accumulation); under the
        other policies the pairs pass through and `after_backward` sums the step's gradient once."""
        if self.policy.name != "every_microbatch":
            yield from steps
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for batch, is_last in steps:
            earlier = [p.grad for p in params]
            for param in params:
                param.grad = None
            yield batch, is_last
            self.sync_gradients(model)
            for param, grad in zip(params, earlier, strict=True):
                if grad is not None:
                    grad += param.grad
                    param.grad = grad

    def after_backward(self, model: nn.Module) -> None:
        """After the step's last backward, before the vote: gradients (unless every microbatch's were
        summed already) and aux-free expert loads summed over the participating groups (each group then
        applies the same update and bias step)."""
        if self.policy.name != "every_microbatch":
            self.sync_gradients(model)
        for moe in model.moe_layers():
            self.manager.allreduce(moe.load_since_update, reduce_op=_SUM).wait()

    def commit(self) -> bool:
        """Whether every participating group got through this step (all ranks of all groups call it once)."""
        return bool(self.manager.should_commit())

    def writes_checkpoints(self) -> bool:
        """Whether this group writes the run's checkpoints: the lowest participating one."""
        return self.manager.participating_rank() == 0

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


_SUM = torch.distributed.ReduceOp.SUM
