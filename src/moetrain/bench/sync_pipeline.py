"""`moetrain bench sync --pp N`: the sync policies under a pipeline schedule, on the same drawn microbatch costs.

Every replica group is one pipeline: `pp` ranks (each `shard` wide) running torch's schedule
(`Schedule1F1B` or `ScheduleInterleaved1F1B`) over the step's `accum` microbatches, the bench MLP's
layers split evenly over the pp x pp_stages_per_rank stages, each stage an FSDP root over its
data-parallel ranks that keeps its weights gathered through the step (as moetrain's PP does). A
microbatch's drawn cost travels with it as a keyword argument chunked like the input, so each
stage sleeps its share of the cost of the microbatch it is running, whatever the schedule's order.

`PolicyStage` sets FSDP's flags from the mode's `grad_sync` policy before each full backward
(`last_backward` from the schedule): `hsdp` reduce-scatters and all-reduces after every microbatch,
coupling the pipelines at each stage's every backward; `hsdp-delayed` all-reduces with the last
one; `hsdp-final-only` is torch's own stage, which syncs once after the schedule's last backward
(`perform_reduce_grad`): what moetrain trains with. Each stage also records its own compute seconds
per microbatch (the blocks' `ComputeClock`), from which the simulator predicts the same step.
This module runs the PP variant's models and steps; the interleaving, calibration and report are
`sync`'s, `sync_calibration`'s and `sync_report`'s.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B, _PipelineSchedule

from moetrain.bench.sync_model import ComputeClock, build_model
from moetrain.bench.sync_options import SyncBenchOptions
from moetrain.config.parallel import ParallelConfig
from moetrain.parallel.grad_sync import SYNC_POLICIES, SyncPolicy, set_sync_flags
from moetrain.parallel.mesh import JobMesh
from moetrain.parallel.shard import apply_fsdp


class StageBlocks(nn.Module):
    """Consecutive blocks of the bench MLP (one stage); `cost` is the running microbatch's drawn seconds."""

    def __init__(self, blocks: list[nn.Module], clock: ComputeClock, first: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.clock, self.first = clock, first

    def forward(self, x: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
        self.clock.sleep_s = float(cost[0])
        if self.first:  # the first block's backward (and its share of the sleep) must run too
            x = x.detach().requires_grad_(True)
        for layer in self.layers:
            x = layer(x)
        return x


class PolicyStage(PipelineStage):
    """A pipeline stage whose full backward syncs gradients as `policy` says; records compute per microbatch."""

    def __init__(self, *args, policy: SyncPolicy, clock: ComputeClock, accum: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.policy, self.clock = policy, clock
        self.compute_s = np.zeros(accum)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        before = self.clock.busy_s
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self.compute_s[fwd_chunk_id] += self.clock.busy_s - before
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        before = self.clock.busy_s
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self.compute_s[bwd_chunk_id] += self.clock.busy_s - before
        return out

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if self.policy.name == "final_only":  # torch's own: no sync until perform_reduce_grad
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # The flags FSDP's post-backward hooks read during this backward; weights stay gathered in between.
        set_sync_flags(self.submod, self.policy.flags(last_backward))
        self.submod.set_is_last_backward(last_backward)
        self.submod.set_reshard_after_backward(False)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


def stage_ids(opts: SyncBenchOptions, pp_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` runs: looped (stage s on rank s mod pp), as torch's schedules expect."""
    return [pp_rank + k * opts.pp for k in range(opts.pp_stages_per_rank)]


def build_pipeline(opts: SyncBenchOptions, clock: ComputeClock, mode_setup: tuple[str, str], world_size: int,
                   device: torch.device) -> tuple[JobMesh, _PipelineSchedule, list[PolicyStage]]:
    """This rank's stages of the bench MLP on the mode's mesh, FSDP-wrapped, and torch's schedule over them."""
    replicate = opts.replicate if mode_setup[0] == "R" else 1
    parallel = ParallelConfig(pp=opts.pp, pp_schedule=opts.pp_schedule, pp_stages_per_rank=opts.pp_stages_per_rank,
                              dp_replicate=replicate, dp_shard=world_size // (opts.pp * replicate),
                              reshard_after_forward=False)
    job = JobMesh.from_config(parallel, world_size, device)
    pp_rank, n_stages = job.pipeline.get_local_rank(), opts.pp * opts.pp_stages_per_rank
    blocks = list(build_model(opts, clock, opts.seed).layers)  # every rank draws the same whole model
    per_stage = opts.layers // n_stages
    # Activations carry gradients: a stage's received input must require grad for its backward.
    hidden = torch.empty(opts.microbatch_size, opts.seq_len, opts.dim, device="meta", requires_grad=True)
    stages = []
    for stage in stage_ids(opts, pp_rank):
        module = StageBlocks(blocks[stage * per_stage:(stage + 1) * per_stage], clock, first=stage == 0).to(device)
        apply_fsdp(module, job, parallel)
        stages.append(PolicyStage(module, stage, n_stages, device, group=job.pipeline.get_group(),
                                  input_args=hidden, output_args=hidden, policy=SYNC_POLICIES[mode_setup[1]],
                                  clock=clock, accum=opts.accum))
    loss = lambda output, target: output.square().mean()  # noqa: E731  the bench's loss, as without PP
    if opts.pp_schedule == "1F1B":
        schedule = Schedule1F1B(stages[0], opts.accum, loss_fn=loss, scale_grads=False)
    else:
        schedule = ScheduleInterleaved1F1B(stages, opts.accum, loss_fn=loss, scale_grads=False)
    return job, schedule, stages


def run_pipeline_step(schedule: _PipelineSchedule, stages: list[PolicyStage], opts: SyncBenchOptions,
                      clock: ComputeClock, costs: np.ndarray, device: torch.device,
                      generator: torch.Generator) -> tuple[float, float, list[float]]:
    """One step of the schedule; (step s, own compute s, own compute s per microbatch), as `sync._run_step`."""
    x = torch.randn(opts.accum * opts.microbatch_size, opts.seq_len, opts.dim, generator=generator).to(device)
    cost = torch.as_tensor(np.repeat(costs, opts.microbatch_size), dtype=torch.float64, device=device)
    target = torch.zeros(opts.accum * opts.microbatch_size, device=device)
    for stage in stages:
        stage.compute_s[:] = 0.0
    clock.busy_s = 0.0
    dist.barrier()
    start = time.perf_counter()
    args = (x,) if stages[0].is_first else ()
    schedule.step(*args, target=target, cost=cost)
    elapsed = time.perf_counter() - start
    for stage in stages:
        stage.submod.zero_grad(set_to_none=True)
    return elapsed, clock.busy_s, list(np.sum([stage.compute_s for stage in stages], axis=0))
