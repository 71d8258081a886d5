"""`moetrain estimate` under tensor (`parallel.tp`) and context (`parallel.cp`) parallelism, without process groups.

The parameters TP keeps whole are checked against the model's own parameter names, a CP rank's activations
against what autograd saves when the tiled attention CP runs serves the whole row in one process, the
traffic against closed forms written out per collective, and `estimate --propose` against the world size,
the device and what the model allows.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moetrain.config.job import JobConfig, parse_job_args
from moetrain.model.attention import AttentionPlan
from moetrain.model.layers import positions_from_documents
from moetrain.model.memory_estimate import estimate_peak, sequence_split_traffic, tp_replicated_params
from moetrain.model.tiled_attention import IDENTITY, TiledAttention, plan_tiles
from moetrain.model.transformer import Transformer
from moetrain.train.loss import token_loss_sum
from moetrain.train.pipeline_estimate import propose_layouts

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config", str(ROOT / "configs" / "tiny_moe.toml"), "--data.seq_len", "256", "--train.microbatch_size", "1",
        "--train.sample_tokens", "0", "--model.moe.aux_loss_scope", "global_batch"]
REPLICATED_NAMES = ("norm.weight", ".router.", "shared_expert_gate", ".wq_a.", ".wkv_a.")


@pytest.mark.parametrize("argv", [[*TINY, "--model.moe.n_shared_experts", "1"],
                                  ["--config", str(ROOT / "configs" / "deepseek_v3_debug.toml")]],
                         ids=["tiny-shared", "deepseek-debug-mla"])
def test_tp_keeps_whole_exactly_the_parameters_its_plan_does_not_split(argv):
    cfg = parse_job_args(argv)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    whole = sum(p.numel() for name, p in model.named_parameters() if any(key in name for key in REPLICATED_NAMES))
    assert tp_replicated_params(cfg.model) == whole


def test_tp_and_cp_split_the_state_between_the_fsdp_bound_and_the_replicated_part():
    cfg = parse_job_args(TINY)
    with torch.device("meta"):
        total = sum(p.numel() for p in Transformer(cfg.model).parameters())
    split = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=2, cp=2))
    weights = estimate_peak(split, 2).weights // 4  # float32 parameters on one rank of dp_shard 2 x cp 2 x tp 2
    assert total // 8 < weights < total // 4
    replicated = tp_replicated_params(cfg.model)
    assert abs(weights - ((total - replicated) / 8 + replicated / 4)) <= 2


def saved_with_tiled_attention(cfg: JobConfig) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward + loss when every layer's
    attention is the tiled attention over the whole row (what each CP rank runs on its share)."""
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.init_weights(seed=0)
    seq = cfg.data.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (1, seq))
    documents = (torch.arange(seq) >= seq // 3).long().unsqueeze(0)
    index = torch.arange(seq)

    def attention(q, k, v, sinks, window):
        plan = plan_tiles(index, index, documents, window, q.shape[0] * q.shape[2])
        return TiledAttention.apply(q, k, v, sinks, plan, IDENTITY)

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in parameters:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens, positions=positions_from_documents(documents),
                       attention_plan=AttentionPlan("context", external=attention))
        token_loss_sum(logits, tokens)
    return sum(saved.values())


@pytest.mark.parametrize("extra", [[], ["--model.n_kv_heads", "2", "--model.qk_norm", "none"]], ids=["tiny", "gqa"])
def test_a_cp_rank_saves_its_share_of_what_the_tiled_attention_saves_for_the_whole_row(extra):
    cfg = parse_job_args([*TINY, *extra])
    measured = saved_with_tiled_attention(cfg)
    cp = 4
    peak = estimate_peak(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp=cp)))
    # The loss keeps one float32 copy of the logits; the other two in `logits` are the backward's.
    estimated = cp * (peak.activations + peak.logits // 3)
    assert abs(estimated / measured - 1) < 0.10, (estimated, measured)
    assert peak.attention_mask == 0 < estimate_peak(cfg).attention_mask  # no [queries x row] mask under CP


def test_tp_and_cp_traffic_per_step_is_the_sum_of_their_collectives():
    cfg = parse_job_args([*TINY, "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
                          "--model.n_kv_heads", "2", "--model.head_dim", "8", "--data.seq_len", "64",
                          "--train.microbatch_size", "2", "--train.grad_accum", "3", "--parallel.tp", "2",
                          "--parallel.cp", "2"])
    traffic = sequence_split_traffic(cfg)
    assert traffic.tokens_per_rank == 2 * 64 // 4
    # A TP collective moves the [2, 64 / cp, 32] float32 stream, a rank receiving half; 8 per forward (embedding,
    # head, attention x 2 blocks, the dense block's FFN), as many in backward; 3 microbatches.
    stream = 2 * 32 * 32 * 4
    assert traffic.tp_bytes == 3 * 2 * 8 * stream // 2
    # CP moves K and V of 2 KV heads / tp x 8 channels over the whole rows per layer, a rank receiving half:
    # gathered in forward, again in backward, their gradients reduce-scattered; 2 layers, 3 microbatches.
    assert traffic.cp_bytes == 3 * 3 * 2 * (2 * 64 * 2 * 1 * 8 * 4) // 2


def test_proposals_use_cp_and_tp_where_the_data_parallel_layouts_do_not_fit():
    cfg = parse_job_args([*TINY, "--data.seq_len", "16384", "--model.max_seq_len", "16384", "--model.n_heads", "2",
                          "--model.head_dim", "128"])
    plain = estimate_peak(cfg, 8)
    split = estimate_peak(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp=4)), 2)
    budget = (plain.peak + split.peak) // 2  # between the best data-parallel peak and a CP 4 rank's
    layouts = propose_layouts(cfg, 8, 8, budget, "cuda")
    assert layouts and all(layout.peak_bytes <= budget for layout in layouts)
    assert all(layout.cp * layout.tp > 1 for layout in layouts)  # the sequence must be split to fit
    assert all(layout.pp * layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp == 8 for layout in layouts)
    assert {layout.tp for layout in layouts} <= {1, 2}  # 2 heads: tp 4 or 8 would split one
    moved = [layout.moved_bytes for layout in layouts]
    assert moved == sorted(moved)
