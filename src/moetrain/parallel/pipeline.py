"""Pipeline parallelism: which layers each stage holds, which stages each rank runs, and torch's schedule.

The layers are split into `pp x pp_stages_per_rank` stages of consecutive layers, the token embedding
in the first stage, the final norm and LM head in the last. The split balances the stages' compute
(`layer_costs`): a block costs the matmul parameters one token passes through (attention, then a
dense feed-forward, or the router, the shared expert and top_k routed experts: the FLOP count of
`moetrain.model.flops` divided by 6, attention scores left out as they are the same in every block),
the head costs its vocab x dim matmul and the embedding (a lookup) nothing; the split minimises the
most expensive stage. So a DeepSeek-V3-shaped model's cheap dense first layers and its head even out.
Multi-token-prediction modules (`model.mtp_depth`) live in the last stage, each costing its block, its
projection and one more pass through the head; that rank also holds a copy of the token embedding for
them (docs/design/mtp.md).

Stages go to pipeline ranks as torch's schedules expect: one per rank (1F1B), looped (stage s on
rank s mod pp: Interleaved1F1B) or V-shaped (rank r holds stages r and 2 pp - 1 - r: ZBVZeroBubble).

`PipelineModel` is what a rank holds: `model`, one `Transformer` part with all of the rank's layers
(the owner of names: checkpoints, the optimizer, clipping and MoE bookkeeping see the whole model's
names, only fewer of them), and `parts`, one part per stage sharing `model`'s modules, each its own
FSDP root wrapped in a torch `PipelineStage`. `build_schedule` makes the schedule; torch's stages
run each microbatch's backward without gradient sync and reduce once after the last one
(`PipelineStage.perform_reduce_grad`), which is where the replicate all-reduce happens.

This module splits and schedules; it must not compute losses (moetrain.train.pipeline_step) nor
build or initialise weights (moetrain.train.build).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,
)

from moetrain.config.model import ModelConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.errors import ConfigError
from moetrain.model.flops import count_params
from moetrain.model.transformer import Transformer
from moetrain.parallel.mesh import JobMesh

SCHEDULES = {"1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
             "ZBVZeroBubble": ScheduleZBVZeroBubble}


def layer_costs(cfg: ModelConfig) -> tuple[list[int], int]:
    """(cost of each block, cost of the norm + head and MTP modules): matmul parameters one token passes through."""
    def matmul_params(n_dense: int) -> int:
        return count_params(dataclasses.replace(cfg, n_layers=1, n_dense_layers=n_dense))["active_matmul"]

    head = cfg.vocab_size * cfg.dim
    dense, moe = matmul_params(1) - head, matmul_params(0) - head
    # MTP module k: its block (layer n_layers + k, past the dense layers: MoE), eh_proj and the head once more.
    mtp = cfg.mtp_depth * (moe + 2 * cfg.dim * cfg.dim + head)
    return [dense if i < cfg.n_dense_layers else moe for i in range(cfg.n_layers)], head + mtp


def split_layers(costs: list[int], n_stages: int, head_cost: int = 0) -> list[range]:
    """Consecutive layer ranges, one per stage, each non-empty, minimising the most expensive stage
    (the last one also pays `head_cost`); ties go to the split with the earliest boundaries."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ConfigError(f"parallel.pp x parallel.pp_stages_per_rank = {n_stages} stages is invalid: must be in "
                          f"[1, model.n_layers = {n}]")
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[s][i]: the smallest possible maximum stage cost putting layers [0, i) into s stages.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            extra = head_cost if s == n_stages else 0
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    ranges, end = [], n
    for s in range(n_stages, 0, -1):
        start = cut[s][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


def rank_stages(pp_rank: int, parallel: ParallelConfig) -> list[int]:
    """The stage indices pipeline rank `pp_rank` runs, in the order torch's schedule lists them."""
    pp, per_rank = parallel.pp, parallel.pp_stages_per_rank
    if parallel.pp_schedule == "ZBVZeroBubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def stage_rank(stage: int, parallel: ParallelConfig) -> int:
    """The pipeline rank that runs `stage` (the inverse of `rank_stages`)."""
    pp = parallel.pp
    if parallel.pp_schedule == "ZBVZeroBubble":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


@dataclass
class PipelineModel:
    """A rank's share of a pipelined model: `model` owns the names, `parts[k]` runs stage `stage_ids[k]`."""

    model: Transformer
    parts: list[Transformer]
    stage_ids: list[int]
    n_stages: int

    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids


def pipeline_parts(cfg: ModelConfig, parallel: ParallelConfig, pp_rank: int) -> PipelineModel:
    """This pipeline rank's model and stage parts, on the meta device (nothing parallelized yet)."""
    costs, head_cost = layer_costs(cfg)
    ranges = split_layers(costs, parallel.pp_stages, head_cost)
    stage_ids = rank_stages(pp_rank, parallel)
    n_stages = len(ranges)
    held = sorted(layer for s in stage_ids for layer in ranges[s])
    holds_last = n_stages - 1 in stage_ids
    with torch.device("meta"):  # the last stage's MTP modules embed with a copy of the embedding
        model = Transformer(cfg, held, embedding=0 in stage_ids or (holds_last and cfg.mtp_depth > 0), head=holds_last)
    parts = [Transformer.part_of(model, ranges[s], embedding=s == 0, head=s == n_stages - 1) for s in stage_ids]
    return PipelineModel(model, parts, stage_ids, n_stages)


def build_schedule(pipeline: PipelineModel, job: JobMesh, parallel: ParallelConfig, n_microbatches: int,
                   loss_fn: Callable, shapes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> _PipelineSchedule:
    """torch's schedule over this rank's stages; gradients are not scaled (the loss carries 1 / N_global).

    `shapes`: (tokens, hidden states, logits) of one microbatch (meta tensors), every stage's inputs
    and outputs given up front, so torch runs no shape-inference forward of its own.
    """
    if job.pipeline is None:
        raise ConfigError(f"parallel.pp = {parallel.pp} needs a mesh with a pipeline dimension: build it with "
                          "moetrain.parallel.mesh.JobMesh from the same config")
    group = job.pipeline.get_group()
    tokens, hidden, logits = shapes
    last = pipeline.n_stages - 1
    stages = [PipelineStage(part, stage_id, pipeline.n_stages, job.device, group=group,
                            input_args=tokens if stage_id == 0 else hidden,
                            output_args=logits if stage_id == last else hidden)
              for part, stage_id in zip(pipeline.parts, pipeline.stage_ids, strict=True)]
    schedule_cls = SCHEDULES[parallel.pp_schedule]
    if schedule_cls is Schedule1F1B:
        return schedule_cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
