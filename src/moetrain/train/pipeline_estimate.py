"""Memory and traffic of a pipeline-parallel job per rank, and the layouts of a cluster that fit, ranked.

`pipeline_peak` is `estimate_peak` for the heaviest pipeline rank: the weights, gradients and optimizer
state of the layers the stage split gives it (`moetrain.parallel.pipeline`: embedding on the first
stage, norm and head on the last), and the activations of the microbatches the schedule keeps in
flight there (`in_flight`). `propose_layouts` enumerates pp x dp_replicate x dp_shard (x ep inside the
shard ranks) for a world, estimates each one's peak and its all-gather and all-to-all bytes per step
and rank, and ranks those that fit by the bytes they move. It reads configs only: no model, no data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moetrain.config.job import JobConfig
from moetrain.config.parallel import ParallelConfig, check_sequence_split
from moetrain.errors import ConfigError
from moetrain.model.flops import count_params
from moetrain.model.memory_estimate import (
    DTYPE_BYTES,
    PeakEstimate,
    estimate_peak,
    format_bytes,
    optimizer_state_bytes,
    rank_params,
    sequence_split_traffic,
    tp_replicated_params,
)
from moetrain.parallel.pipeline import layer_costs, rank_stages, split_layers


@dataclass(frozen=True)
class RankShare:
    """What one pipeline rank holds: its layers (dense ones apart), whether the embedding / head, its parameters."""

    layers: int
    dense_layers: int
    moe_layers: int
    holds_first: bool
    holds_last: bool
    params: int
    expert_params: int


def layer_params(cfg: JobConfig) -> tuple[int, int, int]:
    """(parameters of a dense block, of an MoE block, routed-expert parameters of an MoE block)."""
    m = cfg.model

    def block(n_dense: int) -> dict[str, int]:
        return count_params(dataclasses.replace(m, n_layers=1, n_dense_layers=n_dense))

    ends = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.dim  # embedding, head, final norm
    return block(1)["total"] - ends, block(0)["total"] - ends, block(0)["routed_experts"]


def rank_share(cfg: JobConfig, pp_rank: int) -> RankShare:
    m, parallel = cfg.model, cfg.parallel
    costs, head = layer_costs(m)
    ranges = split_layers(costs, parallel.pp_stages, head)
    stages = rank_stages(pp_rank, parallel) if parallel.pp > 1 else [0]
    layers = [layer for s in stages for layer in ranges[s]]
    dense = sum(1 for layer in layers if layer < m.n_dense_layers)
    dense_params, moe_params, expert_params = layer_params(cfg)
    first, last = 0 in stages, len(ranges) - 1 in stages
    ends = m.vocab_size * m.dim * (first + last) + (m.dim if last else 0)
    return RankShare(len(layers), dense, len(layers) - dense, first, last,
                     dense * dense_params + (len(layers) - dense) * moe_params + ends,
                     (len(layers) - dense) * expert_params)


def in_flight(parallel: ParallelConfig, n_micro: int, pp_rank: int) -> float:
    """Microbatches whose activations pipeline rank `pp_rank` holds at once, in units of all its layers.

    1F1B: the first rank starts pp forwards before its first backward, rank r pp - r. Interleaved1F1B
    (v stages per rank): torch's warm-up, (v - 1) x microbatches per round + 2 (pp - 1 - r) + 1
    stage-microbatches, each 1/v of the rank's layers. ZBVZeroBubble: the V shape gives every rank
    about the first rank's 1F1B count (the zero-bubble paper's memory claim), pp.
    """
    pp, v = parallel.pp, parallel.pp_stages_per_rank
    if pp == 1:
        return 1.0
    if parallel.pp_schedule == "Interleaved1F1B":
        per_round = n_micro // max(1, n_micro // pp)
        return min(n_micro * v, (v - 1) * per_round + 2 * (pp - 1 - pp_rank) + 1) / v
    if parallel.pp_schedule == "ZBVZeroBubble":
        return float(min(n_micro, pp))
    return float(min(n_micro, pp - pp_rank))


def pipeline_peak(cfg: JobConfig, shard: int, device_type: str, process_bytes: int, data_bytes: int,
                  activation_checkpointing: bool, host_heap: bool) -> tuple[PeakEstimate, int]:
    """(the peak of the heaviest pipeline rank, that rank): estimate_peak of the rank's layers, with its own
    parameters and the activations of `in_flight` microbatches; logits only where the head is."""
    best: tuple[PeakEstimate, int] | None = None
    for pp_rank in range(cfg.parallel.pp):
        share = rank_share(cfg, pp_rank)
        stage_model = dataclasses.replace(cfg.model, n_layers=share.layers, n_dense_layers=share.dense_layers)
        base = estimate_peak(dataclasses.replace(cfg, model=stage_model), shard, device_type, process_bytes,
                             data_bytes, activation_checkpointing, host_heap)
        flying = in_flight(cfg.parallel, cfg.train.grad_accum, pp_rank)
        state = rank_params(cfg, share.params, tp_replicated_params(stage_model), shard)
        peak = dataclasses.replace(base, weights=4 * state, gradients=4 * state,
                                   optimizer=optimizer_state_bytes(cfg, state),
                                   activations=int(base.activations * flying),
                                   logits=base.logits if share.holds_last else 0)
        if cfg.parallel.pp > 1 and shard > 1:
            # A stage keeps its weights gathered through the step and its gradients unsharded until the
            # schedule's last backward (moetrain.train.pipeline_step): the rank's layers, experts split by EP.
            gathered = share.params - share.expert_params + share.expert_params // cfg.parallel.ep
            parallel = cfg.parallel
            peak = dataclasses.replace(peak, fsdp_buffers=gathered * (DTYPE_BYTES[parallel.param_dtype]
                                                                      + DTYPE_BYTES[parallel.reduce_dtype]))
        if best is None or peak.peak > best[0].peak:
            best = (peak, pp_rank)
    return best


@dataclass(frozen=True)
class Layout:
    pp: int
    dp_replicate: int
    dp_shard: int
    ep: int
    cp: int
    tp: int
    peak_bytes: int
    all_gather_bytes: int
    all_to_all_bytes: int
    sequence_split_bytes: int  # TP's and CP's collectives (memory_estimate.sequence_split_traffic)

    @property
    def name(self) -> str:
        return (f"pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} (ep {self.ep})"
                f" x cp {self.cp} x tp {self.tp}")

    @property
    def moved_bytes(self) -> int:
        return self.all_gather_bytes + self.all_to_all_bytes + self.sequence_split_bytes


def traffic(cfg: JobConfig, shard: int) -> tuple[int, int]:
    """(all-gather, all-to-all) bytes per step of the heaviest rank. FSDP gathers a rank's parameters
    (experts over dp_shard / ep ranks) twice per microbatch when it reshards after forward, once per step
    under PP (a stage keeps them); the all-to-all sends top_k rows of dim per token and MoE layer, there
    and back, in forward and backward, the (ep - 1) / ep share that leaves the rank."""
    parallel, m = cfg.parallel, cfg.model
    share = max((rank_share(cfg, r) for r in range(parallel.pp)), key=lambda s: s.params)
    act = DTYPE_BYTES[parallel.param_dtype]
    gathers = 1 if parallel.pp > 1 or not parallel.reshard_after_forward else 2 * cfg.train.grad_accum
    # Under CP and TP, FSDP shards over dp_shard x cp, and TP splits a rank's share; experts over efsdp x cp x tp.
    fsdp, efsdp = shard * parallel.cp, shard // parallel.ep * parallel.cp * parallel.tp
    dense = (share.params - share.expert_params) / parallel.tp * (fsdp - 1) / fsdp
    experts = share.expert_params / parallel.ep * (efsdp - 1) / max(efsdp, 1)
    all_gather = int((dense + experts) * act * gathers)
    tokens = cfg.train.grad_accum * cfg.train.microbatch_size * cfg.data.seq_len // (parallel.cp * parallel.tp)
    all_to_all = int(tokens * m.moe.top_k * m.dim * act * share.moe_layers * 4 * (parallel.ep - 1) / parallel.ep)
    return all_gather, all_to_all


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(cfg: JobConfig, ranks: int) -> list[tuple[int, int]]:
    """(cp, tp) pairs dividing `ranks` that the job's model and rows allow (check_sequence_split), judged with the
    options TP/CP need and a user can switch (no sampling, no compile, no eval tasks, global-batch aux loss)."""
    train = dataclasses.replace(cfg.train, sample_tokens=0, compile=False, eval_tasks=())
    moe = dataclasses.replace(cfg.model.moe, aux_loss_scope="global_batch")
    model = dataclasses.replace(cfg.model, moe=moe)
    pairs = []
    for cp in _divisors(ranks):
        for tp in _divisors(ranks // cp):
            try:
                check_sequence_split(dataclasses.replace(cfg.parallel, cp=cp, tp=tp), model, cfg.data, train)
            except ConfigError:
                continue
            pairs.append((cp, tp))
    return pairs


def propose_layouts(cfg: JobConfig, world: int, per_node: int, available: int, device_type: str) -> list[Layout]:
    """Every pp x dp_replicate x dp_shard x ep x cp x tp layout of `world` ranks whose heaviest rank fits
    `available` bytes, fewest bytes moved per step first. cp x tp stays inside a node (their collectives run
    every layer) and does not combine with pp yet (the pipeline's stages are not TP/CP-split); replicas span
    whole nodes (dp_shard x cp x tp a multiple of per_node or one node's divisor); a pipeline takes at least
    pp microbatches (train.grad_accum raised to pp); 1F1B."""
    m = cfg.model
    layouts = []
    for pp in _divisors(world):
        if pp > m.n_layers or (pp > 1 and m.tie_embeddings):
            continue
        for cp, tp in _splits(cfg, per_node if pp == 1 else 1):
            if (world // pp) % (cp * tp):
                continue
            data_world = world // (pp * cp * tp)
            for replicate in _divisors(data_world):
                shard = data_world // replicate
                if (shard * cp * tp) % per_node and per_node % (shard * cp * tp):
                    continue
                for ep in _divisors(shard):
                    layout = _layout(cfg, pp, replicate, shard, ep, cp, tp, available, device_type)
                    if layout is not None:
                        layouts.append(layout)
    return sorted(layouts, key=lambda layout: (layout.moved_bytes, layout.peak_bytes))


def _layout(cfg: JobConfig, pp: int, replicate: int, shard: int, ep: int, cp: int, tp: int, available: int,
            device_type: str) -> Layout | None:
    """The layout's peak and traffic, or None when it is impossible or does not fit `available` bytes."""
    m = cfg.model
    if m.n_layers == m.n_dense_layers and ep > 1 or m.moe.n_experts % ep:
        return None
    parallel = dataclasses.replace(cfg.parallel, pp=pp, dp_replicate=replicate, dp_shard=shard, ep=ep, cp=cp, tp=tp,
                                   pp_schedule="1F1B", pp_stages_per_rank=1)
    train = dataclasses.replace(cfg.train, grad_accum=max(cfg.train.grad_accum, pp))
    job = dataclasses.replace(cfg, parallel=parallel, train=train)
    try:
        peak = pipeline_peak(job, shard, device_type, 0, 0,
                             cfg.train.activation_checkpointing not in (False, "none"), False)[0]
    except ConfigError:
        return None
    if peak.peak > available:
        return None
    split = sequence_split_traffic(job)
    return Layout(pp, replicate, shard, ep, cp, tp, peak.peak, *traffic(job, shard), split.tp_bytes + split.cp_bytes)


def describe_layouts(layouts: list[Layout], where: str, limit: int = 10) -> str:
    """The first `limit` layouts as lines of text."""
    if not layouts:
        return f"no pp x dp_replicate x dp_shard x ep x cp x tp layout fits {where}"
    rows = [f"layouts that fit {where}, fewest bytes moved per step and rank first ({len(layouts)} fit; cp/tp > 1 "
            "need train.sample_tokens = 0, compile off, no eval_tasks, global_batch aux loss):"]
    rows += [f"  {layout.name:<58} peak {format_bytes(layout.peak_bytes):>10}  all-gather "
             f"{format_bytes(layout.all_gather_bytes):>10}  all-to-all {format_bytes(layout.all_to_all_bytes):>10}"
             f"  TP/CP {format_bytes(layout.sequence_split_bytes):>10}"
             for layout in layouts[:limit]]
    return "\n".join(rows)
