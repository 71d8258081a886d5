"""When a run saves and where it resumes: the `Checkpointer` of a run directory's `checkpoints/`.

`maybe_save(step)` saves every `checkpoint.every` steps and at the run's last step;
`resume_point()` picks, per `checkpoint.resume` = true/false/"auto", the newest intact checkpoint,
after comparing the job's config with the checkpoint's.

Asynchronous saves (`checkpoint.async_save`): the training loop captures the state of the step
and returns; the rest of the save runs in a background thread (`moetrain.checkpoint.storage`).
Captured on the loop: the small state (step, counters, every rank's loader position and RNG
states, gathered and turned into JSON and tensor copies right there, so it is that step's state
whatever the loop does next) and a copy of the model and optimizer tensors in host memory (DCP's
`DefaultStager`: a device-to-host copy on a GPU, a memory copy on a CPU; its buffers are kept and
reused by later saves). In the background, unchanged: the finiteness check, DCP's write of every
rank's shards, the hashing, the manifest, the rename and the prune, in that order; the rename
still comes only after every rank's files are written and hashed, so a crash at any point of a
background save leaves a `.tmp-*` directory and the previous checkpoint intact. At most one save
is in flight: the next save, the end of the run and a signal's stop wait for it, and a failure in
the background (a full disk, a non-finite state, a lost peer) is raised there, on the training
loop of every rank, as the same error a synchronous save raises. Pruning happens only inside a
save, after its rename, so it never races another save.

Test hooks (`moetrain.runtime.faults`) crash after a step on request. This module decides when
and where; it must not read or write a checkpoint's files itself.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from moetrain.checkpoint.layout import CheckpointRef, latest_complete, list_complete, step_dir_name
from moetrain.checkpoint.manifest import newest_intact
from moetrain.checkpoint.state import check_resume_config
from moetrain.checkpoint.storage import (
    BackgroundSave,
    ignore_single_process_warning,
    save_checkpoint,
    snapshot,
    tensor_state,
)
from moetrain.config.checkpoint import CheckpointConfig
from moetrain.config.job import JobConfig
from moetrain.errors import ConfigError, PoisonedStateError, TrainingDiverged
from moetrain.logging import get_logger
from moetrain.parallel.collectives import distributed, rank_and_world
from moetrain.runtime import faults

log = get_logger("checkpoint")


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
        self._in_flight: BackgroundSave | None = None
        self._failure_logged = False
        self._stager: DefaultStager | None = None
        self._background_ready = False  # the background group made (or, in one process, not needed)
        self._group: dist.ProcessGroup | None = None

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
        snap = snapshot(self.dir, step, {}, state.trainer_state(), state.per_rank_state(), self.cfg.keep_last,
                        state.cfg.to_dict(), protect, self.damaged)
        snap.tensors = self._staged(tensor_state(state.model, state.optimizer))
        self._in_flight = BackgroundSave(snap, self._background_group())
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

    def _background_group(self) -> dist.ProcessGroup | None:
        """The background save's own process group (gloo, created once, collectively, on first use); None in one
        process."""
        if not self._background_ready:
            if distributed() and dist.get_world_size() > 1:
                timeout = None if self.collective_timeout_s is None else timedelta(seconds=self.collective_timeout_s)
                self._group = dist.new_group(backend="gloo", timeout=timeout)
            else:
                ignore_single_process_warning()
            self._background_ready = True
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
