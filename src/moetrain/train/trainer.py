"""The Trainer: one optimizer step, evaluation, and the state a checkpoint holds.

Built by `moetrain.train.run` once the process group, the job's mesh and data exist. It gets its
model from the one builder (`moetrain.train.build`) and owns the optimizer, schedule and
data loader.

One step: take this rank's `grad_accum` microbatches of the step's global batch from
the loader (the same global batch for any number of ranks: moetrain.data.loader), count the step's valid
target tokens over all ranks (one all-reduce), under the global-batch balance loss
count the step's expert assignments (`global_balance`), run forward/backward per
microbatch under the sync policy (`grad_sync.accumulation`), each microbatch's loss
being its summed token loss over the global count plus its part of the MoE router
losses (`loss.router_loss_terms`); then one small all-reduce of [loss sum, balance
loss, z-loss, non-finite flag, input tokens] — the time a rank
spends in it is its wait for the slowest rank — clip by the global gradient norm,
and step the optimizer unless the loss or norm is NaN/inf (then, with `train.qk_clip_tau`, clip the attention
heads whose logits the step's forwards recorded above τ: `qk_clip`). Under expert parallelism
the time in the MoE token all-to-alls is reported on its own (`all_to_all_s`, with the
rows each rank sent and received) and left out of the compute time. Deciding what a
non-finite step means, when to evaluate, log or save is the run's job, not this one's.

Under fault-tolerant HSDP (`ft.enabled`, `moetrain.parallel.fault_tolerance`) the step first asks
for its quorum (a rejoining group loads a live peer's state there), the token count and the small
totals are also summed over the participating replica groups, their gradients after the last
microbatch or after each (the sync policy's), and the step is applied only when torchft's vote
commits it; otherwise it is redone from the same data position.

Under pipeline parallelism (`parallel.pp > 1`) the model is the rank's stages and the microbatches
run through torch's schedule instead (`moetrain.train.pipeline_step`); the rest of the step is shared.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.profiler import record_function

from moetrain.checkpoint.layout import CheckpointRef
from moetrain.checkpoint.lora_base import STATE_KEY as LORA_BASE_KEY
from moetrain.checkpoint.lora_base import base_identity
from moetrain.checkpoint.state import capture_rng_state, restore_rng_state
from moetrain.checkpoint.storage import load_checkpoint
from moetrain.config.job import JobConfig
from moetrain.data.batching import build_batching
from moetrain.data.dataset import TrainingData
from moetrain.data.loader import DataLoader
from moetrain.data.packing import IGNORE_INDEX
from moetrain.dtypes import DTYPES
from moetrain.errors import ConfigError
from moetrain.evaluate.tasks import evaluate_choice_tasks, read_choice_tasks
from moetrain.logging import get_logger
from moetrain.model.flops import count_params, flops_per_token
from moetrain.observe.metrics import StepResult, bits_per_byte, train_record
from moetrain.observe.peak_flops import rank_peak_flops
from moetrain.observe.peak_memory import PeakMemory
from moetrain.observe.step_phases import StepPhases
from moetrain.parallel.collectives import all_gather_floats, all_reduce_sum
from moetrain.parallel.context_parallel import SequenceSplit
from moetrain.parallel.expert_parallel import all_to_all_stats
from moetrain.parallel.fault_tolerance import (
    ReplicaGroup,
    data_position,
    load_recovery_state,
    parameter_checksum,
    recovery_state,
)
from moetrain.parallel.float8 import precompute_float8_scales
from moetrain.parallel.grad_sync import accumulation, clip_grad_norm_, count_global_tokens, resolve_sync_policy
from moetrain.parallel.mesh import JobMesh
from moetrain.parallel.parallelize import runs_unsharded
from moetrain.parallel.precision import compute_copy
from moetrain.train.build import build_for_job, build_pipeline
from moetrain.train.global_balance import prepare_global_balance
from moetrain.train.loss import (
    microbatch_loss,
    mtp_loss_term,
    mtp_valid_counts,
    router_loss_terms,
    token_loss_sum,
)
from moetrain.train.optim import LRSchedule, build_optimizer, set_lr
from moetrain.train.pipeline_step import PipelineStep
from moetrain.train.qk_clip import job_qk_clip

log = get_logger("train")


@dataclass(frozen=True)
class StepTotals:
    """What every step sums over ranks in its one small all-reduce (float64 on the wire)."""

    loss_sum: float  # summed token loss of this rank's microbatches
    balance_loss: float  # this rank's part of the load-balance loss
    z_loss: float  # this rank's part of the router z-loss
    nonfinite_ranks: float  # 1 when this rank's sums are NaN/inf, so the sum counts such ranks
    input_tokens: float  # input tokens this rank fed the model
    mtp_loss: float = 0.0  # this rank's part of the step's multi-token-prediction loss (1/D) Σ_k CE_k

    @classmethod
    def summed_over_ranks(cls, local: StepTotals, device: torch.device) -> StepTotals:
        values = torch.tensor([getattr(local, f.name) for f in fields(cls)], dtype=torch.float64, device=device)
        return cls(*(float(v) for v in all_reduce_sum(values).cpu()))


@dataclass(frozen=True)
class RankTimes:
    """One rank's times and all-to-all traffic in a step, gathered to every rank for the record."""

    compute_s: float
    wait_s: float
    step_s: float
    all_to_all_s: float
    all_to_all_rows_sent: float
    all_to_all_rows_received: float

    @classmethod
    def gathered(cls, local: RankTimes, extra: list[float]) -> list[tuple[RankTimes, list[float]]]:
        """(times, extra values) of every rank, in rank order; `extra` is as long on every rank."""
        n = len(fields(cls))
        rows = all_gather_floats([getattr(local, f.name) for f in fields(cls)] + list(extra))
        return [(cls(*row[:n]), list(row[n:])) for row in rows]


@dataclass(frozen=True)
class EvalSchedule:
    """When the run evaluates on the held-out split: every `every` steps (0 = never) and after the last step."""

    every: int
    last_step: int

    def due(self, step: int) -> bool:
        """An evaluation between steps; the one after the last step is the run's final report, not this."""
        return self.every > 0 and step % self.every == 0 and step != self.last_step


def eval_indices(n_sequences: int, wanted: int, rank: int, world: int) -> list[int]:
    """This rank's share of `wanted` evenly spaced held-out sequences, the same set at every evaluation.

    The total is rounded down to a multiple of the world size (at least one per rank,
    repeating sequences only when there are fewer than ranks) so every rank runs the same
    number of forwards, which FSDP's collectives require. For the usual wanted (a power
    of two) and world sizes the set does not depend on the world size, so held-out numbers
    are comparable across meshes.
    """
    total = max(world, (min(wanted, n_sequences) // world) * world)
    chosen = [(i * n_sequences) // total for i in range(total)]
    return chosen[rank::world]


class Trainer:
    def __init__(self, cfg: JobConfig, data: TrainingData, job: JobMesh):
        self.cfg = cfg
        self.data = data
        self.job = job
        self.device = job.device
        self.rank, self.world = job.rank, job.world
        self.eval_tasks = read_choice_tasks(cfg.train.eval_tasks)  # checked before anything is built
        self.policy = resolve_sync_policy(cfg.parallel, job.dims, cfg.train.grad_accum)
        # Context/tensor parallelism: each rank's slice of the microbatches its CP x TP group shares.
        self.split = SequenceSplit.of(job)
        torch.manual_seed(cfg.train.seed)
        # Under pipeline parallelism the rank holds its stages; `model` is their union (moetrain.train.pipeline_step).
        self.pipeline = PipelineStep(cfg, job, build_pipeline(cfg, job)) if job.pipeline is not None else None
        self.model = self.pipeline.model if self.pipeline is not None else build_for_job(cfg, job)
        self.compute_copy = compute_copy(self.model, cfg.parallel)  # None under FSDP or in float32
        self.all_to_all = all_to_all_stats(self.model)  # None without expert parallelism
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.float8_gathered = cfg.train.float8 == "tensorwise" and not runs_unsharded(job)
        # QK-clip: each head's largest logit recorded during the step, its weights clipped after it.
        self.qk_clip = job_qk_clip(self.model, cfg.train.qk_clip_tau, job, self.pipeline)
        self.max_logits: torch.Tensor | None = None  # [layers, heads] of the last clipped step
        self.schedule = LRSchedule.from_config(cfg.train)
        batching = build_batching(data.train, cfg.data, cfg.train.microbatch_size, cfg.train.seed)
        dp_rank, dp_world = job.data_rank, job.data_world
        if cfg.ft.enabled:  # this group's share of every step's global batch
            dp_rank, dp_world = data_position(cfg.ft, dp_rank, dp_world)
        self.loader = DataLoader(batching, seed=cfg.train.seed, dp_rank=dp_rank, dp_world=dp_world,
                                 microbatches_per_rank=cfg.train.grad_accum)
        self.replicas: ReplicaGroup | None = None  # set by the run under ft.enabled (attach_replicas)
        self.group_tokens = 0  # this replica group's valid tokens in the last step (ft only)
        self.group_loss_sum = 0.0  # and their summed token loss
        self.redone_steps = 0  # steps redone because a replica group was lost mid-step (ft only)
        self.step_input_tokens = 0  # all ranks' input tokens in the last step (varies under token budgets)
        self.token_bytes = data.token_bytes.to(self.device)
        self.params = count_params(cfg.model)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.step = 0
        self.skipped_steps = 0
        self.tokens_seen = 0
        self.memory = PeakMemory(self.device)  # the first record's peak includes building the model
        self._peak_flops: float | None = None
        self.peak_flops_source = ""  # where the peak came from (rank 0 knows; the others say so)

    @property
    def tokens_per_rank_step(self) -> float:
        """Input tokens per rank in the last step (the mean over ranks: token-budget microbatches differ)."""
        return self.step_input_tokens / self.world

    # ---- state

    def trainer_state(self) -> dict[str, Any]:
        state = {"skipped_steps": self.skipped_steps, "tokens_seen": self.tokens_seen, "seed": self.cfg.train.seed}
        if self.cfg.lora.enabled:  # which frozen base the adapters belong to (checkpoint/lora_base.py)
            state[LORA_BASE_KEY] = base_identity(self.cfg)
        return state

    def per_rank_state(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict(), "rng": capture_rng_state()}

    def attach_replicas(self, replicas: ReplicaGroup) -> None:
        """Run as one replica group of a fault-tolerant run from now on (after any checkpoint restore)."""
        replicas.set_step(self.step)
        self.replicas = replicas

    def recovery_state(self) -> dict[str, Any]:
        """What a rejoining group's rank copies from this rank (torchft calls it at a quorum that needs it)."""
        return {**recovery_state(self.model, self.optimizer), "trainer": self.trainer_state(), "step": self.step,
                "loader": self.loader.state_dict(), "fingerprint": self.replicas.fingerprint}

    def load_recovery_state(self, state: dict[str, Any]) -> None:
        """Take a live peer rank's `recovery_state`: weights, optimizer, expert bias, counters, data position."""
        if state["fingerprint"] != self.replicas.fingerprint:
            raise ConfigError("the live replica groups run another config or moetrain version than this group: "
                              "start it from the same job and code")
        load_recovery_state(self.model, self.optimizer, state)
        self.step = int(state["step"])
        self.skipped_steps = int(state["trainer"]["skipped_steps"])
        self.tokens_seen = int(state["trainer"]["tokens_seen"])
        self.loader.load_state_dict(state["loader"])
        log.info("recovered step %d from a live replica group (weights, optimizer, expert bias, data position)",
                 self.step)

    def restore(self, ref: CheckpointRef) -> None:
        state = load_checkpoint(ref, self.model, self.optimizer,
                                like=(self.trainer_state(), self.per_rank_state()))
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        self.tokens_seen = int(state["tokens_seen"])
        ranks = state["ranks"]
        # The loader position is a global cursor, the same on every rank and for any world
        # size, so the data order continues exactly on any number of ranks.
        self.loader.load_state_dict(ranks[0]["loader"])
        if len(ranks) == self.world:
            restore_rng_state(ranks[self.rank]["rng"])
        else:
            # Weights and optimizer were resharded by DCP; per-rank RNG states have no counterpart.
            log.info("checkpoint was written by %d ranks, resuming on %d: same global data order, "
                     "RNG states not restored", len(ranks), self.world)

    # ---- one step

    def train_step(self) -> StepResult:
        """One optimizer step; under ft.enabled, redone (same data) until the participating groups commit it."""
        while True:
            result = self._attempt_step()
            if result is not None:
                return result
            self.redone_steps += 1
            log.warning("step %d was not committed (a replica group was lost or failed mid-step); redoing it with "
                        "the groups of the next quorum", self.step + 1)

    def _attempt_step(self) -> StepResult | None:
        cfg = self.cfg.train
        start = time.perf_counter()
        phases = StepPhases(self.device)
        position = self._begin_attempt(phases)  # may load a live peer's state: read self.step after it
        lr = self.schedule.lr(self.step)
        set_lr(self.optimizer, lr)
        if self.all_to_all is not None:
            self.all_to_all.take()  # what evaluation or sampling moved belongs to no step
        with phases.phase("data"):
            microbatches = [batch.to(self.device) for batch in self.loader.next_microbatches()]
        # Every stage of a pipeline reads the same microbatches: the first stage's ranks count the inputs.
        counts_inputs = self.pipeline is None or self.pipeline.pipeline.holds_first
        input_tokens = (float(sum(batch.tokens.numel() for batch in microbatches)) / self.split.replicas
                        if counts_inputs else 0.0)
        with phases.phase("collectives"):
            global_tokens = self._count_tokens(microbatches)
        if self.pipeline is not None:
            loss_sum, aux_sum, z_sum, expert_load, mtp_sum, mtp_counts = self._pipeline_microbatches(
                microbatches, global_tokens, phases)
        else:
            loss_sum, aux_sum, z_sum, expert_load, mtp_sum, mtp_counts = self._accumulate(microbatches,
                                                                                          global_tokens, phases)
        if self.replicas is not None:
            self.replicas.after_backward(self.model)  # the replicate all-reduce (once per step unless per microbatch)
        # Under expert parallelism the token all-to-alls are reported on their own, not as compute.
        a2a_s, a2a_sent, a2a_received = self.all_to_all.take() if self.all_to_all is not None else (0.0, 0, 0)
        compute_s = time.perf_counter() - start - a2a_s
        # The first collective after the local work: how long this rank waits here is
        # how much earlier it finished than the slowest rank.
        wait_start = time.perf_counter()
        with phases.phase("wait"):
            local_finite = all(bool(torch.isfinite(t)) for t in (loss_sum, aux_sum, z_sum)) and math.isfinite(mtp_sum)
            local = StepTotals(loss_sum=float(loss_sum), balance_loss=float(aux_sum), z_loss=float(z_sum),
                               nonfinite_ranks=0.0 if local_finite else 1.0, input_tokens=float(input_tokens),
                               mtp_loss=mtp_sum)
            totals = self._sum_totals(local)
        wait_s = time.perf_counter() - wait_start
        denominator = max(global_tokens, 1)
        loss = totals.loss_sum / denominator
        aux_loss = totals.balance_loss
        z_loss = totals.z_loss
        with phases.phase("optimizer"):
            pipeline_group = self.pipeline.pipeline_group if self.pipeline is not None else None
            grad_norm = float(clip_grad_norm_(self.model, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"),
                                              pipeline=pipeline_group))
            finite = totals.nonfinite_ranks == 0 and math.isfinite(grad_norm) and math.isfinite(loss)
            if self.replicas is not None and not self.replicas.commit():
                self._forget_attempt(position)
                return None
            if finite:
                with record_function("optimizer"):  # a label in profiler traces
                    self.optimizer.step()
                if self.pipeline is not None:  # the last stage's copy of the embedding (MTP) takes the new weights
                    self.pipeline.after_optimizer_step(self.optimizer)
                if self.float8_gathered:  # the next all-gathers' float8 scales, in one collective
                    precompute_float8_scales(self.model)
                if self.qk_clip is not None:
                    self.max_logits = self.qk_clip.clip()
            elif self.qk_clip is not None:
                self.qk_clip.disarm()
            self.optimizer.zero_grad(set_to_none=True)
            if finite:
                loads_sum = self.pipeline.stage_all_reduce if self.pipeline is not None else all_reduce_sum
                self.model.update_expert_bias(loads_sum if self.world > 1 else None)
            else:
                self.model.discard_pending_expert_load()  # this step's loads are not applied
        self.step += 1
        self.step_input_tokens = int(totals.input_tokens)
        self.tokens_seen += self.step_input_tokens
        return StepResult(loss=loss, aux_loss=aux_loss, grad_norm=grad_norm, lr=lr, global_tokens=global_tokens,
                          compute_s=compute_s, wait_s=wait_s, step_s=time.perf_counter() - start, skipped=not finite,
                          expert_load=expert_load, all_to_all_s=a2a_s, all_to_all_rows_sent=a2a_sent,
                          all_to_all_rows_received=a2a_received, z_loss=z_loss, phases=phases.seconds,
                          mtp_loss=totals.mtp_loss if mtp_counts is not None else None)

    def _pipeline_microbatches(self, microbatches, global_tokens: int, phases: StepPhases):
        """The PP branch of `_accumulate`; the step's expert load is not recorded (each stage has its own layers),
        the MTP loss is the last stage's (moetrain.train.pipeline_step)."""
        with self._compute_dtype():
            with phases.phase("forward"):  # the schedule interleaves forwards and backwards: all of it here
                self.pipeline.route_step(microbatches)
                if self.qk_clip is not None:  # after the routing pass: only the training forwards are recorded
                    self.qk_clip.arm()
                totals = self.pipeline.run(microbatches, global_tokens)
        return tuple(torch.tensor(value, dtype=torch.float64) for value in
                     (totals.loss_sum, totals.balance_loss, totals.z_loss)) + (None, totals.mtp_loss, totals.mtp_counts)

    def _accumulate(self, microbatches, global_tokens: int, phases: StepPhases):
        """Forward and backward of each microbatch under the sync policy: (loss, balance, z sums; expert load;
        the MTP loss sum and the step's valid targets per MTP depth, None without MTP)."""
        cfg = self.cfg.train
        aux_is_share = self.cfg.model.moe.aux_loss_scope == "global_batch"
        loss_sum = torch.zeros((), dtype=torch.float64)
        aux_sum = torch.zeros((), dtype=torch.float64)
        z_sum = torch.zeros((), dtype=torch.float64)
        expert_load = None
        mtp_weight = cfg.mtp_loss_weight if self.cfg.model.mtp_depth > 0 else 0.0
        mtp_sum, mtp_counts = 0.0, None
        if mtp_weight > 0:  # the step's valid targets of each MTP depth, over every rank (one all-reduce)
            with phases.phase("collectives"):
                local_counts = torch.tensor([mtp_valid_counts(b.targets, b.document_ids, self.cfg.model.mtp_depth)
                                             for b in microbatches], dtype=torch.int64).sum(dim=0)
                mtp_counts = (all_reduce_sum(local_counts.to(self.device)) // self.split.replicas).tolist()
        with self._compute_dtype(backwards=len(microbatches)):
            with phases.phase("forward"):
                prepare_global_balance(self.model, microbatches, self.split.model_inputs, self.split.tp)
            if self.qk_clip is not None:
                self.qk_clip.arm()
            steps = accumulation(self.model, microbatches, self.policy)
            if self.replicas is not None:  # (ft) the managed all-reduce after each microbatch, when its policy says so
                steps = self.replicas.accumulation(self.model, steps)
            for batch, _is_last in steps:
                with phases.phase("forward"), self.split.loss_context():
                    outputs = self.model(**self.split.model_inputs(batch, mtp_depth=len(mtp_counts or ())))
                    logits = outputs[0] if mtp_counts is not None else outputs
                    mb_loss_sum, n_valid = token_loss_sum(logits, self.split.shard(batch.targets))
                    mb_loss_sum = self.split.local_loss(mb_loss_sum)
                    aux = self.model.aux_loss()
                    z = self.model.z_loss_sum(self.split.routed_mask(batch.targets != IGNORE_INDEX))
                    objective = microbatch_loss(mb_loss_sum, n_valid, global_tokens, aux, z, aux_is_share)
                    if mtp_counts is not None:  # + λ/D Σ_k CE_k (moetrain.train.loss)
                        mtp_objective, mtp_part = mtp_loss_term(outputs[1], batch.targets, batch.document_ids,
                                                                mtp_counts, mtp_weight, self.split)
                        objective = objective + mtp_objective
                        mtp_sum += mtp_part
                with phases.phase("backward"), self.split.loss_context():
                    objective.backward()
                loss_sum += mb_loss_sum.detach().double().cpu() / self.split.tp  # each TP rank: the whole loss
                balance_term, z_term = router_loss_terms(n_valid, global_tokens, aux.detach(), z.detach(),
                                                         aux_is_share)
                aux_sum += torch.as_tensor(balance_term).double().cpu()
                z_sum += torch.as_tensor(z_term).double().cpu()
                load = self.model.tokens_per_expert()
                if load is not None:
                    load = load.cpu().double()
                    expert_load = load if expert_load is None else expert_load + load
        return loss_sum, aux_sum, z_sum, expert_load, mtp_sum, mtp_counts

    def _begin_attempt(self, phases: StepPhases) -> dict[str, Any]:
        """(ft) this step's quorum, where a rejoining group loads a live peer's state; then the data
        position an uncommitted attempt starts again from."""
        if self.replicas is not None:
            with phases.phase("collectives"):  # the quorum (and a recovery) is part of the step's time
                self.replicas.begin_step(self.step)
            return self.loader.state_dict()
        return {}

    def _count_tokens(self, microbatches: list) -> int:
        """The step's valid target tokens: over this group's ranks, then (ft) over the participating groups."""
        self.group_tokens = (self.pipeline.count_global_tokens(microbatches) if self.pipeline is not None else
                             count_global_tokens(sum(batch.n_valid_targets for batch in microbatches),
                                                 replicas=self.split.replicas))
        if self.replicas is None:
            return self.group_tokens
        return int(self.replicas.exchange([float(self.group_tokens)])[0])  # exact: integers in float64

    def _sum_totals(self, local: StepTotals) -> StepTotals:
        """The step's totals over this group's ranks, then (ft) over the participating groups."""
        totals = StepTotals.summed_over_ranks(local, self.device)
        self.group_loss_sum = totals.loss_sum
        if self.replicas is None:
            return totals
        return StepTotals(*self.replicas.exchange([getattr(totals, f.name) for f in fields(StepTotals)]))

    def _forget_attempt(self, position: dict[str, Any]) -> None:
        """Undo a step the replica groups did not commit: gradients, expert loads, data position."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.discard_pending_expert_load()
        self.loader.load_state_dict(position)

    def _compute_dtype(self, backwards: int = 0) -> AbstractContextManager:
        """Where forwards (and their `backwards`, when known) run on `parallel.param_dtype` weights when FSDP does
        not cast them."""
        return self.compute_copy.compute(backwards) if self.compute_copy is not None else nullcontext()

    def train_record(self, result: StepResult, window: list[StepResult]) -> dict[str, Any]:
        """The metrics record of the step just taken (collective: every rank calls it)."""
        memory = self.memory.read_and_reset()  # peaks since the previous record, this rank
        ranks = RankTimes.gathered(RankTimes(result.compute_s, result.wait_s, result.step_s, result.all_to_all_s,
                                             result.all_to_all_rows_sent, result.all_to_all_rows_received),
                                   list(memory.values()))
        memory_per_rank = {name: [extra[i] for _, extra in ranks] for i, name in enumerate(memory)}
        load = None if result.expert_load is None else all_reduce_sum(result.expert_load.clone())
        all_to_all = ([[r.all_to_all_s, r.all_to_all_rows_sent, r.all_to_all_rows_received] for r, _ in ranks]
                      if self.all_to_all is not None else None)
        times = [[r.compute_s, r.wait_s, r.step_s] for r, _ in ranks]
        record = train_record(step=self.step, result=result, window=window,
                              tokens_per_rank_step=self.tokens_per_rank_step, per_rank_times=times, expert_load=load,
                              flops_per_token=self.flops_per_token, peak_flops=self.peak_flops_per_rank(),
                              tokens_seen=self.tokens_seen, skipped_steps=self.skipped_steps,
                              all_to_all_per_rank=all_to_all, memory_per_rank=memory_per_rank,
                              expert_bias=self._expert_bias())
        record["peak_rss_since_previous_record"] = self.memory.window_peaks  # else the process's lifetime peak
        if self.replicas is not None:  # which groups took part, this group's tokens, and its weights' checksum
            record.update({"ft_replica_id": self.cfg.ft.replica_id, "ft_participants": self.replicas.participants,
                           "ft_group_tokens": self.group_tokens, "ft_group_loss_sum": self.group_loss_sum,
                           "ft_redone_steps": self.redone_steps,
                           "param_checksum": parameter_checksum(self.model)})
        record["peak_flops_per_rank"] = self.peak_flops_per_rank()
        record["peak_flops_source"] = self.peak_flops_source
        if self.max_logits is not None:
            record["attention_max_logit"] = self.max_logits.tolist()  # [layer][head], before the clip
        return record

    def _expert_bias(self) -> torch.Tensor | None:
        """The aux-loss-free expert bias [n_moe_layers, E] (the same on every rank), or None without it."""
        layers = [moe for moe in self.model.moe_layers() if moe.cfg.load_balance == "aux_free"]
        return torch.stack([moe.expert_bias.detach().cpu() for moe in layers]) if layers else None

    def peak_flops_per_rank(self) -> float:
        """MFU's denominator per rank: `train.peak_flops`, or 0 = rank 0's (collective: every rank calls it).

        Rank 0 takes the peak of the threads its host's ranks run at once, at the compute dtype,
        from `moetrain.observe.peak_flops` (cached from an idle measurement), while the other ranks
        wait in the collective that shares it, so no rank's measurement competes with another's.
        """
        if self._peak_flops is None:
            configured = self.cfg.train.peak_flops
            if configured > 0:
                self._peak_flops, self.peak_flops_source = configured, "train.peak_flops"
            else:
                measured, self.peak_flops_source = 0.0, "rank 0's"
                if self.rank == 0:
                    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                    measured, self.peak_flops_source = rank_peak_flops(
                        DTYPES[self.cfg.parallel.param_dtype], self.device, local_ranks=local_ranks)
                self._peak_flops = all_gather_floats([measured])[0][0]
        return self._peak_flops

    # ---- evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        heldout = self.data.heldout
        assert heldout is not None
        mb = self.cfg.train.microbatch_size
        # Every stage of a pipeline, and the ranks of one CP x TP group, evaluate the same sequences: they are
        # split over the data-parallel ranks.
        indices = eval_indices(len(heldout), self.cfg.train.eval_batches * mb, self.job.data_rank,
                               self.job.data_world)
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, valid targets, bytes
        self.model.eval()
        try:
            with self._compute_dtype():  # held-out loss in the dtype the model trains in
                for lo in range(0, len(indices), mb):
                    batch = heldout.batch(indices[lo: lo + mb]).to(self.device)
                    if self.pipeline is not None:
                        logits = self.pipeline.forward_only(batch)
                        if logits is None:  # not the last stage: the last stage's ranks sum the loss
                            continue
                    else:
                        logits = self.model(**self.split.model_inputs(batch))
                    with self.split.loss_context():
                        loss_sum, _ = token_loss_sum(logits, self.split.shard(batch.targets))
                    valid = batch.targets != IGNORE_INDEX
                    n_bytes = self.token_bytes[batch.targets[valid]].sum()
                    # Summed over all ranks: a CP x TP group holds each sequence's tokens once and its loss tp times.
                    totals += torch.tensor([float(self.split.local_loss(loss_sum)) / self.split.tp,
                                            int(valid.sum()) / self.split.replicas,
                                            float(n_bytes) / self.split.replicas], dtype=torch.float64)
        finally:
            self.model.train()
        all_reduce_sum(totals)
        loss_sum, n_tokens, n_bytes = totals.tolist()
        return {"heldout_loss": loss_sum / max(n_tokens, 1), "heldout_bpb": bits_per_byte(loss_sum, int(n_bytes)),
                "heldout_tokens": int(n_tokens)}

    def evaluate_tasks(self) -> dict[str, float]:
        """train.eval_tasks' acc and acc_norm ("task/<name>/acc", ...), documents split over all ranks."""
        with self._compute_dtype():
            return evaluate_choice_tasks(self.model, self.data.tokenizer, self.eval_tasks,
                                         self.cfg.train.microbatch_size, self.device, self.cfg.data.seq_len,
                                         self.rank, self.world, limit=self.cfg.train.eval_tasks_limit or None)
