"""The pipeline's stage split, stage placement, parameter names and refusals, without any process group."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.errors import ConfigError
from moetrain.model.flops import count_params
from moetrain.model.transformer import Transformer
from moetrain.parallel.grad_sync import resolve_sync_policy
from moetrain.parallel.mesh import MeshDims
from moetrain.parallel.pipeline import layer_costs, pipeline_parts, rank_stages, split_layers, stage_rank
from moetrain.train.pipeline_estimate import in_flight, pipeline_peak, propose_layouts, rank_share

DEEPSEEK_LIKE = ModelConfig(vocab_size=259, dim=16, n_layers=8, n_heads=2, ffn_hidden=96, n_dense_layers=2,
                            max_seq_len=16, moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=8,
                                                          n_shared_experts=1))


def brute_force_split(costs: list[int], n_stages: int, head: int) -> int:
    """The smallest possible most expensive stage, over every split into consecutive non-empty stages."""
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), n_stages - 1):
        bounds = (0, *cuts, len(costs))
        stages = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        stages[-1] += head
        best = max(stages) if best is None else min(best, max(stages))
    return best


@pytest.mark.parametrize(("costs", "n_stages", "head"), [
    ([1] * 8, 4, 0), ([1] * 8, 4, 3), ([5, 1, 1, 1, 1, 1, 1, 5], 3, 2), ([3, 9, 9, 9, 9, 9, 9, 9, 9], 4, 12),
    ([2, 7, 1, 8, 2, 8, 1, 8], 8, 5), ([4, 4, 4], 1, 4)])
def test_split_is_consecutive_complete_and_minimises_the_largest_stage(costs, n_stages, head):
    ranges = split_layers(costs, n_stages, head)
    assert [layer for r in ranges for layer in r] == list(range(len(costs)))
    assert all(len(r) > 0 for r in ranges)
    stage_costs = [sum(costs[i] for i in r) for r in ranges]
    stage_costs[-1] += head
    assert max(stage_costs) == brute_force_split(costs, n_stages, head)


def test_dense_first_layers_cost_what_a_token_multiplies_and_the_head_weighs_on_the_last_stage():
    costs, head = layer_costs(DEEPSEEK_LIKE)
    d = DEEPSEEK_LIKE.dim
    attention = 4 * d * d  # wq, wk, wv, wo with 2 heads of 8 (no grouped KV)
    assert costs[:2] == [attention + 3 * d * 96] * 2
    assert costs[2:] == [attention + d * 8 + 3 * d * 8 + 2 * 3 * d * 8] * 6  # router, shared, top-2 experts
    assert head == 259 * d
    # A dense layer alone, then dense + MoE, three MoE layers, and two MoE layers beside the head.
    assert split_layers(costs, 4, head) == [range(0, 1), range(1, 3), range(3, 6), range(6, 8)]


@pytest.mark.parametrize(("schedule", "per_rank"), [("1F1B", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 3),
                                                    ("ZBVZeroBubble", 2)])
def test_every_stage_runs_on_exactly_one_rank(schedule, per_rank):
    parallel = ParallelConfig(pp=4, pp_schedule=schedule, pp_stages_per_rank=per_rank)
    held = [s for rank in range(4) for s in rank_stages(rank, parallel)]
    assert sorted(held) == list(range(4 * per_rank))
    assert all(stage_rank(s, parallel) == rank for rank in range(4) for s in rank_stages(rank, parallel))
    if schedule == "ZBVZeroBubble":
        assert rank_stages(0, parallel) == [0, 7]  # V: the first rank holds the first and the last stage


def test_the_ranks_parts_name_every_parameter_and_buffer_of_the_whole_model_once():
    whole = _whole_names()
    parallel = ParallelConfig(pp=2, pp_schedule="ZBVZeroBubble", pp_stages_per_rank=2)
    names = [name for rank in range(2) for name in pipeline_parts(DEEPSEEK_LIKE, parallel, rank).model.state_dict()]
    assert sorted(names) == sorted(whole)
    rank0 = pipeline_parts(DEEPSEEK_LIKE, parallel, 0)
    assert rank0.holds_first and rank0.holds_last  # V-shaped: stages 0 and 3
    part_names = {name for part in rank0.parts for name in part.state_dict()}
    assert part_names == set(rank0.model.state_dict())


def test_mtp_modules_live_on_the_last_stage_with_a_copy_of_the_embedding_and_weigh_on_it():
    cfg = dataclasses.replace(DEEPSEEK_LIKE, mtp_depth=1)
    costs, head = layer_costs(cfg)
    plain_costs, plain_head = layer_costs(DEEPSEEK_LIKE)
    d = cfg.dim
    assert costs == plain_costs and head == 2 * plain_head + plain_costs[-1] + 2 * d * d  # block, eh_proj, head
    parallel = ParallelConfig(pp=2)
    first, last = (pipeline_parts(cfg, parallel, rank) for rank in range(2))
    with torch.device("meta"):
        whole = set(Transformer(cfg).state_dict())
    # The two ranks together name the whole model; only the embedding is named on both.
    assert set(first.model.state_dict()) | set(last.model.state_dict()) == whole
    assert set(first.model.state_dict()) & set(last.model.state_dict()) == {"tok_embeddings.weight"}
    (last_part,) = last.parts
    assert last_part.tok_embeddings is None and last_part.mtp_embeddings is last.model.tok_embeddings
    assert len(last_part.mtp) == 1 and len(first.parts[0].mtp) == 0


def _whole_names() -> list[str]:
    with torch.device("meta"):
        return list(Transformer(DEEPSEEK_LIKE).state_dict())


def job(**fields) -> JobConfig:
    cfg = JobConfig(model=dataclasses.replace(DEEPSEEK_LIKE))
    cfg.data.seq_len = 16
    for dotted, value in fields.items():
        section, name = dotted.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.mark.parametrize(("fields", "message"), [
    ({"parallel__pp": 4, "parallel__pp_schedule": "Interleaved1F1B", "parallel__pp_stages_per_rank": 3,
      "train__grad_accum": 4}, "parallel.pp = 4 is invalid: x parallel.pp_stages_per_rank = 12 stages is more than"),
    ({"parallel__pp": 2, "train__grad_accum": 1}, "train.grad_accum = 1 is invalid: must be >= 2"),
    ({"parallel__pp": 2, "parallel__pp_schedule": "ZBVZeroBubble", "parallel__pp_stages_per_rank": 2,
      "train__grad_accum": 3}, "train.grad_accum = 3 is invalid: must be >= 4"),
    ({"parallel__pp": 2, "parallel__pp_schedule": "Interleaved1F1B", "parallel__pp_stages_per_rank": 2,
      "train__grad_accum": 3}, "train.grad_accum = 3 is invalid: must be a multiple of parallel.pp = 2"),
    ({"parallel__pp": 2, "parallel__pp_schedule": "Interleaved1F1B"}, "parallel.pp_stages_per_rank = 1 is invalid"),
    ({"parallel__pp": 2, "parallel__pp_schedule": "ZBVZeroBubble", "parallel__pp_stages_per_rank": 3},
     "parallel.pp_stages_per_rank = 3 is invalid: must be 2"),
    ({"parallel__pp": 2, "parallel__pp_schedule": "DualPipeV"}, "parallel.pp_schedule = 'DualPipeV' is invalid"),
    ({"parallel__pp": 2, "train__grad_accum": 2, "model__tie_embeddings": True}, "model.tie_embeddings = True"),
    ({"parallel__pp": 2, "train__grad_accum": 2, "data__batching": "token_budget"}, "data.batching = 'token_budget'"),
])
def test_pipeline_refusals_are_one_line_naming_the_field(fields, message):
    with pytest.raises(ConfigError) as error:
        job(**fields).validate()
    assert message in str(error.value) and "\n" not in str(error.value)



@pytest.mark.parametrize("parallel", [ParallelConfig(pp=4), ParallelConfig(pp=2, pp_schedule="ZBVZeroBubble",
                                                                           pp_stages_per_rank=2)])
def test_the_pipeline_ranks_hold_every_parameter_of_the_whole_model_once(parallel):
    cfg = job()
    cfg.parallel = parallel
    shares = [rank_share(cfg, rank) for rank in range(parallel.pp)]
    assert sum(share.params for share in shares) == count_params(cfg.model)["total"]
    assert sum(share.expert_params for share in shares) == count_params(cfg.model)["routed_experts"]
    assert sum(share.holds_first for share in shares) == sum(share.holds_last for share in shares) == 1


def test_1f1b_keeps_pp_minus_rank_microbatches_in_flight_and_estimates_the_heaviest_rank():
    parallel = ParallelConfig(pp=4)
    assert [in_flight(parallel, 8, rank) for rank in range(4)] == [4, 3, 2, 1]
    assert [in_flight(parallel, 2, rank) for rank in range(4)] == [2, 2, 2, 1]
    cfg = job(parallel__pp=4, train__grad_accum=8)
    peak, rank = pipeline_peak(cfg, 1, "cuda", 0, 0, False, False)
    assert peak.weights == 4 * rank_share(cfg, rank).params
    assert rank == 0 or peak.logits > 0  # the first rank holds the most microbatches, unless the head outweighs it


def test_proposed_layouts_fit_and_come_fewest_bytes_first():
    cfg = job(train__microbatch_size=1)
    layouts = propose_layouts(cfg, 16, 8, 2**21, "cuda")
    assert layouts and all(layout.peak_bytes <= 2**21 for layout in layouts)
    moved = [layout.moved_bytes for layout in layouts]
    assert moved == sorted(moved)
    assert all(layout.pp * layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp == 16 for layout in layouts)


def test_under_a_pipeline_the_sync_policy_is_the_schedules_one_reduction_per_step():
    dims = MeshDims(pp=2, dp_replicate=2, dp_shard=2)
    assert resolve_sync_policy(ParallelConfig(pp=2), dims, 4).name == "final_only"
    with pytest.raises(ConfigError, match="^parallel.sync_policy = 'delayed_all_reduce' is invalid with parallel.pp"):
        resolve_sync_policy(ParallelConfig(pp=2, sync_policy="delayed_all_reduce"), dims, 4)
