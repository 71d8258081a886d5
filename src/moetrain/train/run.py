"""A training run, start to end: `moetrain train --config FILE [--section.field value ...]`.

Order of work, chosen so that a bad config or bad data fails before anything is
written: parse and validate the config, read and pack the corpus, join the process
group and build the mesh, check the run directory (existing checkpoints need
`--checkpoint.resume True` or `auto`; the newest intact one is verified and its config compared
with this job's), build the Trainer (model, optimizer, loader), and only
then restore a checkpoint and start writing into the run directory.

The run owns the process group's lifetime (`parallel.process_group.distributed_job`), logging and the
schedule of everything around the steps: the components decide when they act (`metrics.due(step)`,
`checkpointer.maybe_save(step)`, `evaluation.due(step)`: every `train.eval_every` steps), a
non-finite step is skipped or stops the run per `train.nan_policy`, and the end of
the run evaluates, samples and writes the final record. The step itself is the
Trainer's (`moetrain.train.trainer`).

One writer: rank 0 holds the run directory's lock (`rundir.WriterLock`) from before the
checkpoint check to the end, and a fresh run refuses a directory holding another run's
config.json or metrics.jsonl. A collective that times out (`parallel.collective_timeout_s`)
or loses a peer ends the rank with one line naming the step (exit 3). SIGTERM/SIGINT stop
every rank at the next step boundary, saving first when due (`moetrain.runtime.signals`;
exit 75). Exit codes: 0 done (or stopped at train.stop_at_step), 1 diverged, 2 user
error, 3 collective failed (or, under ft.enabled, the lighthouse lost: after a checkpoint), 75 stopped
by a signal. Under ft.enabled the run is one replica group: it joins the others after any
checkpoint restore, and only the lowest participating group writes checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.contrib.logging import logging_redirect_tqdm

from moetrain.args import take_option
from moetrain.checkpoint.checkpointer import Checkpointer
from moetrain.checkpoint.layout import CheckpointRef, remove_partial
from moetrain.checkpoint.state import stored_config
from moetrain.checkpoint.storage import saved_intra_op_threads
from moetrain.config.job import CommandOption, JobConfig, parse_job_args, to_toml
from moetrain.config.parallel import check_world_size
from moetrain.config.profile import parse_step_range
from moetrain.data.dataset import load_training_data
from moetrain.errors import CollectiveFailed, ConfigError, TrainingDiverged
from moetrain.evaluate.generate import generate
from moetrain.interop import check_architecture
from moetrain.logging import get_logger, setup_logging
from moetrain.observe.metrics import LN2, MetricsWriter, ProgressBar, StepResult, console_line
from moetrain.observe.peak_memory import current_rss_bytes
from moetrain.observe.profiler import ProfilerWindow
from moetrain.parallel.fault_tolerance import ReplicaGroup, ReplicaGroupLost, job_fingerprint, managed_sync_policy
from moetrain.parallel.process_group import distributed_job
from moetrain.runtime.allocator import reuse_freed_host_memory
from moetrain.runtime.disk import no_space_left
from moetrain.runtime.faults import hang_before_step, pause_before_step
from moetrain.runtime.preflight import job_device_type, refuse_if_too_big
from moetrain.runtime.run_dir import RunDir, WriterLock, refuse_foreign_outputs
from moetrain.runtime.signals import EXIT_STOPPED_BY_SIGNAL, StopSignals
from moetrain.runtime.threads import set_intra_op_threads
from moetrain.train.job_estimate import describe, estimate, job_defaults
from moetrain.train.trainer import EvalSchedule, Trainer

log = get_logger("train")
EXIT_COLLECTIVE_FAILED = 3


class _Phase:
    """What the run is doing, for the line that reports a failed collective."""

    where = "the start of the run"


def run(cfg: JobConfig) -> dict[str, Any]:
    """Train per `cfg`; return the final record (rank 0's view)."""
    refuse_if_too_big(cfg)  # before reading data or allocating anything
    data = load_training_data(cfg)
    lock: WriterLock | None = None
    checkpointer: Checkpointer | None = None
    phase = _Phase()
    # The group goes also when the Trainer could not be built (e.g. a mesh that does not fit the world).
    with distributed_job(cfg.parallel) as job:
        try:
            reuse_freed_host_memory(job.world, cfg.lora.enabled)  # one process: large tensors reuse the heap
            run_dir = RunDir(Path(cfg.logging.run_dir))
            lock = WriterLock(run_dir)
            lock.acquire()  # before the checkpoint check: a concurrent run could be writing one
            checkpointer = Checkpointer(run_dir.checkpoints, cfg.checkpoint, cfg.train.stop_at_step or cfg.train.steps,
                                        cfg.logging.run_dir, collective_timeout_s=cfg.parallel.collective_timeout_s)
            resume_from = checkpointer.resume_point(cfg)
            if resume_from is not None:
                _refuse_schedule_change(resume_from, cfg)
            interrupted_threads = None if resume_from is None else saved_intra_op_threads(resume_from)
            threads = set_intra_op_threads(cfg.train.num_threads, interrupted=interrupted_threads)
            refuse_foreign_outputs(run_dir, cfg)
            trainer = Trainer(cfg, data, job)
            try:
                with StopSignals(job.rank, grace_s=cfg.parallel.collective_timeout_s) as stop:
                    return _run(trainer, run_dir, checkpointer, resume_from, stop, phase, threads, lock)
            except RuntimeError as err:
                if not _is_collective_failure(err):
                    raise
                raise CollectiveFailed(_collective_failure(err, job.rank, phase.where,
                                                           cfg.parallel.collective_timeout_s)) from None
        except ConfigError:
            if lock is not None and phase.where == _Phase.where:  # refused before its first step
                lock.undo_start()
            raise
        finally:
            if checkpointer is not None:  # a background save completes before the lock and the group go
                checkpointer.close(raise_errors=False)
            if lock is not None:
                lock.release()


SCHEDULE_FIELDS = ("steps", "warmup_steps", "schedule", "decay_fraction", "min_lr_ratio", "lr")


def _refuse_schedule_change(ref: CheckpointRef, cfg: JobConfig) -> None:
    # A larger train.steps silently stretches a cosine or WSD schedule mid-run: say so unless asked for.
    saved = stored_config(ref)
    finished = saved is not None and ref.step >= saved.train.steps  # the saved run had trained all its steps
    if finished and ref.step >= cfg.train.steps and saved.train.steps != cfg.train.steps:
        # (`make train ARGS="--train.steps 50"` after a finished run would otherwise report the old run again)
        raise ConfigError(f"train.steps = {cfg.train.steps} trains nothing: the run in {ref.path.parent.parent} "
                          f"already reached step {ref.step} (of train.steps = {saved.train.steps}); start another run "
                          "with a new --logging.run_dir, or continue this one with a larger train.steps and "
                          "--checkpoint.allow_schedule_change True")
    if cfg.checkpoint.allow_schedule_change or ref.step >= cfg.train.steps:  # nothing left to train: no effect
        return
    if saved is None:
        return
    for name in SCHEDULE_FIELDS:
        old, new = getattr(saved.train, name), getattr(cfg.train, name)
        if old != new:
            raise ConfigError(f"train.{name} = {new!r} differs from {old!r} in checkpoint {ref.path}: the "
                              "learning-rate schedule would change mid-run; use the checkpoint's value or pass "
                              "--checkpoint.allow_schedule_change True")


def _is_collective_failure(err: RuntimeError) -> bool:
    # gloo reports a timeout or a lost peer as a plain RuntimeError raised from its sources.
    text = str(err)
    return isinstance(err, dist.DistError) or "/gloo/" in text or "Timed out waiting" in text


def _collective_failure(err: RuntimeError, rank: int, where: str, timeout_s: float) -> str:
    text = str(err).strip()
    first_line = text.splitlines()[0][:200] if text else type(err).__name__
    if "timed out" in text.lower() or "timeout" in text.lower():
        return (f"rank {rank}: a collective did not complete within parallel.collective_timeout_s = {timeout_s:g} s "
                f"during {where}: a peer rank is hung or gone ({first_line})")
    return f"rank {rank}: a collective failed during {where}: a peer rank is gone ({first_line})"


def _start(trainer: Trainer, run_dir: RunDir, resume_from: CheckpointRef | None) -> None:
    """Restore the checkpoint (if any), then claim the run directory: config, logs, stale partial writes."""
    if resume_from is not None:
        trainer.restore(resume_from)
    if trainer.rank == 0:
        run_dir.root.mkdir(parents=True, exist_ok=True)
        remove_partial(run_dir.checkpoints)  # writes interrupted in an earlier run, never complete
        with no_space_left(run_dir.config, "run config"):
            run_dir.config.write_text(json.dumps(trainer.cfg.to_dict(), indent=2))
        if resume_from is None and run_dir.metrics.exists():
            run_dir.metrics.unlink()  # no checkpoint: nothing of that run can continue
    setup_logging(log_dir=run_dir.logs if trainer.cfg.logging.all_ranks_to_files else None)


def _announce(trainer: Trainer, metrics: MetricsWriter, event: str, threads: str) -> None:
    """The run's first record ("start" or "resume") and its console lines: ranks, mesh, model, data."""
    data = trainer.data
    metrics.write({
        "kind": "event", "event": event, "step": trainer.step,
        "world_size": trainer.world, "params_total": trainer.params["total"], "params_active": trainer.params["active"],
        "flops_per_token": trainer.flops_per_token, "train_sequences": len(data.train),
        "train_documents": data.n_train_documents, "heldout_documents": data.n_heldout_documents,
        "sync_policy": trainer.policy.name, "intra_op_threads": torch.get_num_threads(), "time": time.time(),
    })
    log.info("%s at step %d: %d ranks (mesh %s, sync %s), %.2fM params (%.2fM active/token), %d train documents "
             "-> %d sequences of %d tokens, %d held-out documents", event, trainer.step,
             trainer.world, trainer.job.describe(), trainer.policy.name,
             trainer.params["total"] / 1e6, trainer.params["active"] / 1e6, data.n_train_documents,
             len(data.train), trainer.cfg.data.seq_len, data.n_heldout_documents)
    log.info("intra-op threads per rank: %s", threads)


def _run(trainer: Trainer, run_dir: RunDir, checkpointer: Checkpointer,
         resume_from: CheckpointRef | None, stop: StopSignals, phase: _Phase, threads: str,
         lock: WriterLock) -> dict[str, Any]:
    cfg = trainer.cfg
    _start(trainer, run_dir, resume_from)
    if cfg.ft.enabled:  # one replica group of a fault-tolerant run: join the others (moetrain lighthouse)
        _join_replica_groups(trainer)
    is_rank0 = trainer.rank == 0
    last_step = checkpointer.last_step
    metrics = MetricsWriter(run_dir.root, enabled=is_rank0, tensorboard=cfg.logging.tensorboard,
                            log_every=cfg.logging.log_every, last_step=last_step,
                            wandb_config=cfg.to_dict() if cfg.logging.wandb else None,
                            wandb_project=cfg.logging.wandb_project)
    evaluation = EvalSchedule(cfg.train.eval_every, last_step=cfg.train.steps)
    _announce(trainer, metrics, "resume" if resume_from else "start", threads)
    bar = ProgressBar(total=cfg.train.steps, initial=trainer.step, enabled=is_rank0 and cfg.logging.progress_bar)
    profiler = ProfilerWindow(parse_step_range(cfg.profile.steps), run_dir.profile, trainer.rank, trainer.device)
    window: list[StepResult] = []
    run_start = time.perf_counter()
    last_save_at = time.monotonic()  # the work a signal-stop without a save would lose starts here
    steps_this_run = 0
    consecutive_skips = 0
    try:
        redirect = logging_redirect_tqdm(loggers=[logging.getLogger("moetrain")]) if bar.active else nullcontext()
        with redirect:
            while trainer.step < last_step:
                phase.where = f"step {trainer.step + 1}"
                hang_before_step(trainer.rank, trainer.step + 1)
                pause_before_step(trainer.step + 1)
                with profiler.step(trainer.step + 1):
                    try:
                        result = _train_step(trainer, phase, first=steps_this_run == 0)
                    except ReplicaGroupLost as err:
                        return _stop_without_lighthouse(trainer, checkpointer, metrics, err)
                steps_this_run += 1
                lock.check_held()  # before this step's writes: a lost run.lock may have let another run in
                window.append(result)
                consecutive_skips = consecutive_skips + 1 if result.skipped else 0
                if result.skipped:
                    _handle_nonfinite(trainer, result, metrics, checkpointer, consecutive_skips)
                bar.update({"loss": f"{result.loss:.3f}", "lr": f"{result.lr:.1e}"})
                if metrics.due(trainer.step):
                    record = trainer.train_record(result, window)
                    window = []
                    metrics.write(record)
                    log.info(console_line(record, cfg.train.steps))
                if evaluation.due(trainer.step):
                    _evaluate_between_steps(trainer, metrics, phase)
                saved = _save_if_due(trainer, run_dir, checkpointer, phase)
                if saved is not None:
                    last_save_at = time.monotonic()
                if trainer.step < last_step:
                    phase.where = f"the stop check after step {trainer.step}"
                    stopping, save = stop.agree(time.monotonic() - last_save_at > cfg.checkpoint.signal_save_after_s)
                    if stopping:
                        return _stop_on_signal(trainer, checkpointer, metrics, stop, save and saved is None,
                                               time.perf_counter() - run_start)
        bar.close()
        phase.where = "the checkpoint being written in the background"
        with no_space_left(run_dir.checkpoints, "checkpoint"):
            checkpointer.wait()  # the last step's save is complete before the run says it is done
        wall_s = time.perf_counter() - run_start
        if trainer.step < cfg.train.steps:
            log.info("stopped at step %d of %d (train.stop_at_step); resume with --checkpoint.resume True",
                     trainer.step, cfg.train.steps)
            final = {"kind": "stopped", "step": trainer.step, "wall_s": wall_s}
            metrics.write(final)
            return final
        phase.where = f"the final evaluation after step {trainer.step}"
        return _finish(trainer, metrics, wall_s, steps_this_run)
    finally:
        profiler.close()
        bar.close()
        metrics.close()
        if trainer.replicas is not None:
            trainer.replicas.shutdown()


def _save_if_due(trainer: Trainer, run_dir: RunDir, checkpointer: Checkpointer,
                 phase: _Phase) -> CheckpointRef | None:
    """The checkpoint of the step just taken when one is due (under ft, only by the group that writes)."""
    phase.where = f"the checkpoint of step {trainer.step}"
    with no_space_left(run_dir.checkpoints, "checkpoint"):
        writes = trainer.replicas is None or trainer.replicas.writes_checkpoints()
        saved = checkpointer.maybe_save(trainer.step, trainer) if writes else None
    if saved is not None:
        log.info("checkpoint %s: %s", "being written in the background" if trainer.cfg.checkpoint.async_save
                 else "saved", saved.path)
    return saved


FT_SHARED = ("model", "data", "train", "parallel")  # what every replica group of a run must agree on


def _join_replica_groups(trainer: Trainer) -> None:
    cfg = trainer.cfg
    shared = {**{k: cfg.to_dict()[k] for k in FT_SHARED}, "groups": cfg.ft.replica_groups}
    policy = managed_sync_policy(cfg.parallel, trainer.job.dims, cfg.train.grad_accum, cfg.ft)
    trainer.attach_replicas(ReplicaGroup.join(cfg.ft, trainer.job, job_fingerprint(shared),
                                              trainer.recovery_state, trainer.load_recovery_state, policy))


def _train_step(trainer: Trainer, phase: _Phase, first: bool) -> StepResult:
    try:
        return trainer.train_step()
    except ConfigError:
        if first and trainer.replicas is not None:
            phase.where = _Phase.where  # refused by the other replica groups at its first step: write nothing
        raise


def _stop_without_lighthouse(trainer: Trainer, checkpointer: Checkpointer, metrics: MetricsWriter,
                             err: ReplicaGroupLost) -> dict[str, Any]:
    """The lighthouse is gone: save this group's state (its own run directory), say one line, stop (exit 3)."""
    with no_space_left(checkpointer.dir, "checkpoint"):
        saved = checkpointer.maybe_save(trainer.step, trainer, force=True) if trainer.cfg.checkpoint.enabled else None
        checkpointer.wait()
    metrics.write({"kind": "stopped", "step": trainer.step, "reason": "lighthouse lost",
                   "checkpoint_step": None if saved is None else saved.step})
    where = f"checkpoint {saved.path.name} saved" if saved is not None else "no checkpoint (checkpoint.enabled = false)"
    raise CollectiveFailed(f"{err}; {where}; restart the lighthouse, then this group with --checkpoint.resume auto")


def _stop_on_signal(trainer: Trainer, checkpointer: Checkpointer, metrics: MetricsWriter, stop: StopSignals,
                    save: bool, wall_s: float) -> dict[str, Any]:
    """End the run after a signal: save when agreed (and enabled), write the record, say one line."""
    cfg, step = trainer.cfg, trainer.step
    saved = None
    with no_space_left(checkpointer.dir, "checkpoint"):
        if save and cfg.checkpoint.enabled:
            saved = checkpointer.maybe_save(step, trainer, force=True)
        checkpointer.wait()  # this save, or one still in the background, is complete before the run stops
    latest = checkpointer.latest()
    if saved is not None:
        outcome = f"checkpoint {saved.path.name} saved"
    elif not cfg.checkpoint.enabled:
        outcome = "no checkpoint (checkpoint.enabled = false)"
    elif latest is not None:
        outcome = (f"newest checkpoint: step {latest.step} (saved less than checkpoint.signal_save_after_s = "
                   f"{cfg.checkpoint.signal_save_after_s:g} s ago)")
    else:
        outcome = "no checkpoint yet"
    signal_name = stop.name or "a signal to another rank"
    final = {"kind": "stopped", "step": step, "wall_s": wall_s, "signal": signal_name,
             "checkpoint_step": None if latest is None else latest.step}
    metrics.write(final)
    then = "resume with --checkpoint.resume True" if latest is not None else "nothing to resume from"
    if trainer.rank == 0:
        print(f"moetrain: stopped by {signal_name} after step {step} of {cfg.train.steps}; {outcome}; {then}",
              file=sys.stderr, flush=True)
    return final


def _handle_nonfinite(trainer: Trainer, result: StepResult, metrics: MetricsWriter,
                      checkpointer: Checkpointer, consecutive_skips: int) -> None:
    what = f"step {trainer.step}: loss {result.loss} / grad norm {result.grad_norm} is not finite"
    if trainer.cfg.train.nan_policy == "stop" or consecutive_skips >= trainer.cfg.train.max_consecutive_skips:
        with no_space_left(checkpointer.dir, "checkpoint"):
            checkpointer.wait()  # a save still in the background completes first: the line names it
    latest = checkpointer.latest()
    where = f"newest complete checkpoint: step {latest.step}" if latest else "no checkpoint was written"
    if trainer.cfg.train.nan_policy == "stop":
        raise TrainingDiverged(f"{what}; stopping (train.nan_policy = 'stop'); {where}")
    cap = trainer.cfg.train.max_consecutive_skips
    if consecutive_skips >= cap:
        raise TrainingDiverged(f"{what}; {consecutive_skips} non-finite steps in a row, giving up "
                               f"(train.nan_policy = 'skip', train.max_consecutive_skips = {cap}); {where}")
    trainer.skipped_steps += 1
    metrics.write({"kind": "event", "event": "skipped_step", "step": trainer.step, "loss": result.loss,
                   "grad_norm": result.grad_norm, "skipped_steps": trainer.skipped_steps})
    log.warning("%s; update skipped (train.nan_policy = 'skip', %d skipped so far)", what, trainer.skipped_steps)


def _evaluate_between_steps(trainer: Trainer, metrics: MetricsWriter, phase: _Phase) -> None:
    """The held-out loss (when there is a held-out split) and the tasks (when any) after this step."""
    if trainer.data.heldout is not None:
        phase.where = f"the evaluation after step {trainer.step}"
        ev = trainer.evaluate()
        metrics.write({"kind": "eval", "step": trainer.step, **ev})
        log.info("step %d | held-out loss %.4f | %.4f bits/byte", trainer.step, ev["heldout_loss"], ev["heldout_bpb"])
    if trainer.eval_tasks:
        phase.where = f"the task evaluation after step {trainer.step}"
        _evaluate_tasks(trainer, metrics)


def _evaluate_tasks(trainer: Trainer, metrics: MetricsWriter) -> dict[str, float]:
    """train.eval_tasks after this step: a "tasks" record and one console line."""
    scores = trainer.evaluate_tasks()
    metrics.write({"kind": "tasks", "step": trainer.step, **scores})
    log.info("step %d | tasks | %s", trainer.step, " | ".join(f"{key.removeprefix('task/')} {value:.4f}"
                                                             for key, value in scores.items()))
    return scores


def _finish(trainer: Trainer, metrics: MetricsWriter, wall_s: float, steps_this_run: int) -> dict[str, Any]:
    cfg, data = trainer.cfg, trainer.data
    final: dict[str, Any] = {"kind": "final", "step": trainer.step, "wall_s": wall_s, "steps_this_run": steps_this_run,
                             "skipped_steps": trainer.skipped_steps, "tokens_seen": trainer.tokens_seen}
    if data.heldout is not None:
        ev = trainer.evaluate()
        metrics.write({"kind": "eval", "step": trainer.step, **ev})
        final.update(ev)
        final["unigram_entropy_bits"] = data.unigram_entropy_bits
        final["train_unigram_entropy_bits"] = data.train_unigram_entropy_bits
        log.info("held-out: loss %.4f nats/token, %.4f bits/byte; unigram byte entropy: held-out text %.4f "
                 "bits/byte (%.4f nats/byte), training text %.4f bits/byte", ev["heldout_loss"], ev["heldout_bpb"],
                 data.unigram_entropy_bits, data.unigram_entropy_bits * LN2, data.train_unigram_entropy_bits)
    else:
        log.info("no held-out documents (data.heldout_fraction = 0): no held-out loss")
    if trainer.eval_tasks:
        final.update(_evaluate_tasks(trainer, metrics))
    if cfg.train.sample_tokens > 0 and trainer.pipeline is not None:
        log.info("no sample: generation does not run through pipeline stages (parallel.pp > 1)")
    elif cfg.train.sample_tokens > 0:
        text = generate(trainer.model, data.tokenizer, cfg.train.sample_prompt, cfg.train.sample_tokens,
                        cfg.train.sample_temperature, cfg.train.sample_top_p, seed=cfg.train.seed,
                        device=trainer.device, max_context=cfg.data.seq_len)
        final["sample"] = cfg.train.sample_prompt + text
        if trainer.rank == 0:
            print(f"--- sample (T={cfg.train.sample_temperature}, top-p={cfg.train.sample_top_p}) ---\n"
                  f"{final['sample']}\n--- end of sample ---", flush=True)
    metrics.write(final)
    log.info("done: %d steps in %.1f s this run", steps_this_run, wall_s)
    return final


DESCRIPTION = ("Train a model: a TOML job (--config) and --section.field overrides. With --model.init_from hf:DIR "
               "and no model fields, the architecture and tokenizer come from DIR (a Hugging Face directory).")


DRY_RUN = CommandOption("dry_run", bool, False, "validate the job (config, HF directory, data, mesh for WORLD_SIZE), "
                        "print the resolved config as TOML and the memory estimate, write nothing; exit 2 when the "
                        "estimated peak does not fit the target")
DRY_RUN_DEVICE = CommandOption("device", str | None, None, "with --dry-run: the target of the estimate, 'cpu', "
                               "'cuda' (this machine's GPU) or a GPU name of `moetrain estimate --help`; "
                               "None = where the job would run")
DRY_RUN_DEVICE_MEMORY = CommandOption("device_memory", float | None, None, "with --dry-run: GiB of one device "
                                      "of the target")


def dry_run(cfg: JobConfig, device: str | None = None, device_memory: str | None = None) -> int:
    """Everything a start checks before it writes, then the resolved config and the estimate; writes nothing.

    ConfigError (one line, exit 2) when the estimated peak per rank exceeds the target's memory."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_world_size(cfg.parallel, world)
    if cfg.model.init_from is not None:
        check_architecture(cfg.model, cfg.model.init_from[3:])
    process_bytes = current_rss_bytes()
    data = load_training_data(cfg)
    data_bytes = max(current_rss_bytes() - process_bytes, 0)  # what the run will hold of it, measured
    target = device or ("cuda" if job_device_type(cfg) == "cuda" else "cpu")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    est = estimate(cfg, world, per_node, target, device_memory, process_bytes, data_bytes)
    if int(os.environ.get("RANK", "0")) == 0:
        print(to_toml(cfg), end="")
        print(f"# data: {data.n_train_documents} train documents -> {len(data.train)} sequences of "
              f"{cfg.data.seq_len} tokens, {data.n_heldout_documents} held-out documents")
        print("\n".join(f"# {line}" for line in describe(est).splitlines()), flush=True)
    if est.fits is False:
        raise ConfigError(est.refusal())
    return 0


def main(argv: list[str]) -> int:
    flags = {"--dry-run": True, "--dry_run": True, "--no-dry-run": False, "--no_dry_run": False}
    dry = [flags[a] for a in argv if a in flags][-1:] == [True]  # the last one given wins
    argv = [a for a in argv if a not in flags]
    device = device_memory = None
    if dry:  # the estimate's target: options of the dry run only
        device, argv = take_option(argv, "device")
        device_memory, argv = take_option(argv, "device-memory")
    cfg = parse_job_args(argv, prog="moetrain train", init_from_defaults=job_defaults, description=DESCRIPTION,
                         options=(DRY_RUN, DRY_RUN_DEVICE, DRY_RUN_DEVICE_MEMORY))
    if dry:
        return dry_run(cfg, device, device_memory)
    setup_logging()
    if int(os.environ.get("RANK", "0")) == 0:  # at once: data, process group and model take a while
        print(f"moetrain train: starting {cfg.logging.run_dir} ({cfg.train.steps} steps; reading data, then "
              "building the model)", flush=True)
    try:
        final = run(cfg)
    except TrainingDiverged as err:
        print(f"moetrain: error: {err}", file=sys.stderr, flush=True)
        return 1
    except CollectiveFailed as err:
        print(f"moetrain: error: {err}", file=sys.stderr, flush=True)
        return EXIT_COLLECTIVE_FAILED
    return EXIT_STOPPED_BY_SIGNAL if final.get("signal") else 0
