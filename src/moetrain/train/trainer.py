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
and step the optimizer unless the loss or norm is NaN/inf. Under expert parallelism
the time in the MoE token all-to-alls is reported on its own (`all_to_all_s`, with the
rows each rank sent and received) and left out of the compute time. Deciding what a
non-finite step means, when to evaluate, log or save is the run's job, not this one's.
"""

from __future__ import annotations

import math
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.profiler import record_function

from moetrain.checkpoint.layout import CheckpointRef
from moetrain.checkpoint.state import capture_rng_state, restore_rng_state
from moetrain.checkpoint.storage import load_checkpoint
from moetrain.config.job import JobConfig
from moetrain.data.batching import build_batching
from moetrain.data.dataset import TrainingData
from moetrain.data.loader import DataLoader
from moetrain.data.packing import IGNORE_INDEX
from moetrain.dtypes import DTYPES
from moetrain.evaluate.tasks import evaluate_choice_tasks, read_choice_tasks
from moetrain.logging import get_logger
from moetrain.model.flops import count_params, flops_per_token
from moetrain.observe.metrics import StepResult, bits_per_byte, train_record
from moetrain.observe.peak_flops import peak_flops
from moetrain.observe.peak_memory import PeakMemory
from moetrain.observe.step_phases import StepPhases
from moetrain.parallel.collectives import all_gather_floats, all_reduce_sum
from moetrain.parallel.context_parallel import SequenceSplit
from moetrain.parallel.expert_parallel import all_to_all_stats
from moetrain.parallel.grad_sync import accumulation, clip_grad_norm_, count_global_tokens, resolve_sync_policy
from moetrain.parallel.mesh import JobMesh
from moetrain.parallel.precision import compute_copy
from moetrain.train.build import build_for_job
from moetrain.train.global_balance import prepare_global_balance
from moetrain.train.loss import microbatch_loss, router_loss_terms, token_loss_sum
from moetrain.train.optim import LRSchedule, build_optimizer, set_lr

log = get_logger("train")


@dataclass(frozen=True)
class StepTotals:
    """What every step sums over ranks in its one small all-reduce (float64 on the wire)."""

    loss_sum: float  # summed token loss of this rank's microbatches
    balance_loss: float  # this rank's part of the load-balance loss
    z_loss: float  # this rank's part of the router z-loss
    nonfinite_ranks: float  # 1 when this rank's sums are NaN/inf, so the sum counts such ranks
    input_tokens: float  # input tokens this rank fed the model

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
        self.model = build_for_job(cfg, job)
        self.compute_copy = compute_copy(self.model, cfg.parallel)  # None under FSDP or in float32
        self.all_to_all = all_to_all_stats(self.model)  # None without expert parallelism
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.schedule = LRSchedule.from_config(cfg.train)
        batching = build_batching(data.train, cfg.data, cfg.train.microbatch_size, cfg.train.seed)
        self.loader = DataLoader(batching, seed=cfg.train.seed, dp_rank=job.data_rank, dp_world=job.data_world,
                                 microbatches_per_rank=cfg.train.grad_accum)
        self.step_input_tokens = 0  # all ranks' input tokens in the last step (varies under token budgets)
        self.token_bytes = data.token_bytes.to(self.device)
        self.params = count_params(cfg.model)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.step = 0
        self.skipped_steps = 0
        self.tokens_seen = 0
        self.memory = PeakMemory(self.device)  # the first record's peak includes building the model
        self._peak_flops: float | None = None

    @property
    def tokens_per_rank_step(self) -> float:
        """Input tokens per rank in the last step (the mean over ranks: token-budget microbatches differ)."""
        return self.step_input_tokens / self.world

    # ---- state

    def trainer_state(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "tokens_seen": self.tokens_seen, "seed": self.cfg.train.seed}

    def per_rank_state(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict(), "rng": capture_rng_state()}

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
        cfg = self.cfg.train
        lr = self.schedule.lr(self.step)
        set_lr(self.optimizer, lr)
        start = time.perf_counter()
        phases = StepPhases(self.device)
        if self.all_to_all is not None:
            self.all_to_all.take()  # what evaluation or sampling moved belongs to no step
        with phases.phase("data"):
            microbatches = [batch.to(self.device) for batch in self.loader.next_microbatches()]
        input_tokens = float(sum(batch.tokens.numel() for batch in microbatches)) / self.split.replicas
        with phases.phase("collectives"):
            global_tokens = count_global_tokens(sum(batch.n_valid_targets for batch in microbatches),
                                                replicas=self.split.replicas)
        aux_is_share = self.cfg.model.moe.aux_loss_scope == "global_batch"
        loss_sum = torch.zeros((), dtype=torch.float64)
        aux_sum = torch.zeros((), dtype=torch.float64)
        z_sum = torch.zeros((), dtype=torch.float64)
        expert_load = None
        with self._compute_dtype():
            with phases.phase("forward"):
                prepare_global_balance(self.model, microbatches, self.split.model_inputs, self.split.tp)
            for batch, _is_last in accumulation(self.model, microbatches, self.policy):
                with phases.phase("forward"), self.split.loss_context():
                    logits = self.model(**self.split.model_inputs(batch))
                    mb_loss_sum, n_valid = token_loss_sum(logits, self.split.shard(batch.targets))
                    mb_loss_sum = self.split.local_loss(mb_loss_sum)
                    aux = self.model.aux_loss()
                    z = self.model.z_loss_sum(self.split.routed_mask(batch.targets != IGNORE_INDEX))
                    objective = microbatch_loss(mb_loss_sum, n_valid, global_tokens, aux, z, aux_is_share)
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
        # Under expert parallelism the token all-to-alls are reported on their own, not as compute.
        a2a_s, a2a_sent, a2a_received = self.all_to_all.take() if self.all_to_all is not None else (0.0, 0, 0)
        compute_s = time.perf_counter() - start - a2a_s
        # The first collective after the local work: how long this rank waits here is
        # how much earlier it finished than the slowest rank.
        wait_start = time.perf_counter()
        with phases.phase("wait"):
            local_finite = all(bool(torch.isfinite(t)) for t in (loss_sum, aux_sum, z_sum))
            local = StepTotals(loss_sum=float(loss_sum), balance_loss=float(aux_sum), z_loss=float(z_sum),
                               nonfinite_ranks=0.0 if local_finite else 1.0, input_tokens=float(input_tokens))
            totals = StepTotals.summed_over_ranks(local, self.device)
        wait_s = time.perf_counter() - wait_start
        denominator = max(global_tokens, 1)
        loss = totals.loss_sum / denominator
        aux_loss = totals.balance_loss
        z_loss = totals.z_loss
        with phases.phase("optimizer"):
            grad_norm = float(clip_grad_norm_(self.model, cfg.grad_clip if cfg.grad_clip > 0 else float("inf")))
            finite = totals.nonfinite_ranks == 0 and math.isfinite(grad_norm) and math.isfinite(loss)
            if finite:
                with record_function("optimizer"):  # a label in profiler traces
                    self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if finite:
                self.model.update_expert_bias(all_reduce_sum if self.world > 1 else None)
            else:
                self.model.discard_pending_expert_load()  # this step's loads are not applied
        self.step += 1
        self.step_input_tokens = int(totals.input_tokens)
        self.tokens_seen += self.step_input_tokens
        return StepResult(loss=loss, aux_loss=aux_loss, grad_norm=grad_norm, lr=lr, global_tokens=global_tokens,
                          compute_s=compute_s, wait_s=wait_s, step_s=time.perf_counter() - start, skipped=not finite,
                          expert_load=expert_load, all_to_all_s=a2a_s, all_to_all_rows_sent=a2a_sent,
                          all_to_all_rows_received=a2a_received, z_loss=z_loss, phases=phases.seconds)

    def _compute_dtype(self) -> AbstractContextManager:
        """Where forwards (and their backwards) run on `parallel.param_dtype` weights when FSDP does not cast them."""
        return self.compute_copy.compute() if self.compute_copy is not None else nullcontext()

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
        record["peak_flops_per_rank"] = self.peak_flops_per_rank()
        return record

    def _expert_bias(self) -> torch.Tensor | None:
        """The aux-loss-free expert bias [n_moe_layers, E] (the same on every rank), or None without it."""
        layers = [moe for moe in self.model.moe_layers() if moe.cfg.load_balance == "aux_free"]
        return torch.stack([moe.expert_bias.detach().cpu() for moe in layers]) if layers else None

    def peak_flops_per_rank(self) -> float:
        """MFU's denominator per rank: `train.peak_flops`, or 0 = measured once (collective: every rank calls it).

        Measured: the mean over ranks of each rank's `peak_flops` at the compute dtype, all
        ranks measuring at once, so on a shared CPU the ranks' sum is what the machine gives them.
        """
        if self._peak_flops is None:
            configured = self.cfg.train.peak_flops
            if configured > 0:
                self._peak_flops = configured
            else:
                measured = peak_flops(DTYPES[self.cfg.parallel.param_dtype], self.device)
                self._peak_flops = sum(r[0] for r in all_gather_floats([measured])) / self.world
        return self._peak_flops

    # ---- evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        heldout = self.data.heldout
        assert heldout is not None
        mb = self.cfg.train.microbatch_size
        # The ranks of one CP x TP group read the same sequences, like their training microbatches.
        indices = eval_indices(len(heldout), self.cfg.train.eval_batches * mb, self.job.data_rank,
                               self.job.data_world)
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, valid targets, bytes
        self.model.eval()
        try:
            with self._compute_dtype():  # held-out loss in the dtype the model trains in
                for lo in range(0, len(indices), mb):
                    batch = heldout.batch(indices[lo: lo + mb]).to(self.device)
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
