"""Expert parallelism (EP): each rank computes only its own experts; routed tokens travel by all-to-all.

Layout (torchtitan's "dp2ep"): the EP group is `parallel.ep` consecutive ranks of the data-parallel
shard dimension (`moetrain.parallel.mesh.JobMesh.experts`). `apply_expert_parallel` turns every MoE
layer's stacked expert weights `w1` [E, d, N] and `w2` [E, n, d] (and their biases `b1` [E, N], `b2`
[E, d] where the family has them, GPT-OSS) into DTensors sharded on dim 0 over the EP group, so EP rank
r owns experts [r·E/ep, (r+1)·E/ep) whole, biases included, and FSDP later shards each rank's
block over the ranks that hold the same experts (`moetrain.parallel.shard`). The global [E, ...]
shape stays, so a checkpoint stores every expert once and DCP reshards it to any other ep or world.

The MoE layer routes its own tokens exactly as without EP (router, top-k, aux losses and expert
loads come before any communication, so none of them depends on ep). `ExpertParallelCompute`
replaces only its expert computation:

1. counts: each rank tells every EP peer how many of its assignments go to each of the peer's
   experts (one all-to-all of E integers); the split sizes follow from them.
2. dispatch: the assignment rows x[token] (grouped by expert, hence by destination rank) and their
   gate scores travel to the owning ranks (all-to-all with uneven splits).
3. local experts: the received rows, ordered expert-major, go through `experts.routed_experts`
   (the configured impl, memory-efficient by default) on contiguous segments, gates applied inside.
4. combine: the results travel back by the reverse all-to-all and are summed per token in float32,
   in the same (expert) order as the single-process computation.

Autograd runs through both all-to-alls: the backward of an all-to-all is the all-to-all with the
splits swapped. Every local expert weight gets a gradient (zero when no token reached it), so FSDP's
reductions have the same layout on every rank, and a rank that receives no token still takes part in
every collective. `AllToAllStats` records the time spent in the all-to-alls (both directions) and
the rows exchanged, for the step metrics. This module changes where expert compute runs, never what
it computes; it holds no optimizer, loss or data logic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.profiler import record_function

from moetrain.model.experts import routed_experts
from moetrain.model.moe import MoE
from moetrain.model.routing import Routing


@dataclass
class AllToAllStats:
    """This rank's all-to-all cost since the last `take()`: seconds (forward and backward, counts
    included) and routed rows sent to / received from other ranks by the dispatches (the combines
    move the same rows back). Under activation checkpointing the recomputed forward moves them again."""

    seconds: float = 0.0
    rows_sent: int = 0
    rows_received: int = 0
    # CUDA: (start, end) events, resolved in take(); timing the host would only time the launch.
    _events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def take(self) -> tuple[float, int, int]:
        """(seconds, rows sent, rows received) accumulated so far; resets the counters."""
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1e3
        result = (self.seconds, self.rows_sent, self.rows_received)
        self.seconds, self.rows_sent, self.rows_received, self._events = 0.0, 0, 0, []
        return result


def _timed_all_to_all(x: Tensor, output_splits: list[int] | None, input_splits: list[int] | None,
                      group: dist.ProcessGroup, stats: AllToAllStats) -> Tensor:
    """all_to_all_single of `x` over `group`, waited for and timed into `stats` (no autograd)."""
    with record_function("all_to_all"):  # a label in profiler traces
        return _timed_all_to_all_unlabelled(x, output_splits, input_splits, group, stats)


def _timed_all_to_all_unlabelled(x: Tensor, output_splits: list[int] | None, input_splits: list[int] | None,
                                 group: dist.ProcessGroup, stats: AllToAllStats) -> Tensor:
    if x.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), output_splits, input_splits, group))
        end.record()
        stats._events.append((start, end))
        return out
    begin = time.perf_counter()
    out = funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), output_splits, input_splits, group))
    stats.seconds += time.perf_counter() - begin
    return out


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all with uneven splits, timed both ways.

    The same computation as `torch.distributed._functional_collectives.all_to_all_single_autograd`
    (whose backward is also the all-to-all with the splits swapped), written out so that the
    backward all-to-all is timed too.
    """

    @staticmethod
    def forward(ctx, x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup,
                stats: AllToAllStats) -> Tensor:  # noqa: D102
        ctx.output_splits, ctx.input_splits, ctx.group, ctx.stats = output_splits, input_splits, group, stats
        return _timed_all_to_all(x, output_splits, input_splits, group, stats)

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # noqa: D102
        grad_in = _timed_all_to_all(grad_out, ctx.input_splits, ctx.output_splits, ctx.group, ctx.stats)
        return grad_in, None, None, None, None


def expert_major_order(counts_SJ: Tensor) -> Tensor:
    """Row permutation that reorders received rows from source-major to expert-major.

    The dispatch delivers, for each source rank s in turn, its rows for local experts 0..J-1
    (`counts_SJ[s, j]` rows each). Returns `order` with received[order] grouped by expert, and
    within an expert by source rank, which is the global token order of that expert's rows.
    """
    sources, experts = counts_SJ.shape
    flat = counts_SJ.reshape(-1)
    starts_SJ = (flat.cumsum(0) - flat).reshape(sources, experts)
    lengths = counts_SJ.t().reshape(-1)  # expert-major segments
    starts = starts_SJ.t().reshape(-1)
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=flat.device), lengths)
    out_starts = lengths.cumsum(0) - lengths
    position = torch.arange(int(flat.sum()), device=flat.device)
    return starts[segment] + position - out_starts[segment]


class ExpertParallelCompute:
    """The MoE's expert computation under EP: dispatch, local experts, combine (see the module docstring).

    Same call contract as `experts.routed_experts`: (x [T, d], routing over all E experts, w1, w2,
    activation, impl) -> out [T, d]. `w1`/`w2` are the layer's (FSDP-unsharded) expert weights, DTensors
    sharded on dim 0 over the EP group, or this rank's local [E/ep, ...] slices.
    """

    def __init__(self, group: dist.ProcessGroup, stats: AllToAllStats):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stats = stats

    def __call__(self, x_TD: Tensor, routing: Routing, w1: Tensor, w2: Tensor, activation: str = "swiglu",
                 impl: str = "memory_efficient", b1: Tensor | None = None, b2: Tensor | None = None,
                 float8: bool = False) -> Tensor:
        w1_JDN, w2_JFD, b1_JN, b2_JD = (t.to_local() if isinstance(t, DTensor) else t for t in (w1, w2, b1, b2))
        n_local = w1_JDN.shape[0]
        if n_local * self.ep != routing.n_experts:
            raise ValueError(f"expert parallelism over {self.ep} ranks: {n_local} local experts per rank "
                             f"do not cover the routing's {routing.n_experts} experts")
        ep, stats = self.ep, self.stats
        counts_E = routing.counts.to(torch.long)
        # 1. counts: received [source, local expert]; with them both sides know every split size.
        recv_counts_SJ = _timed_all_to_all(counts_E, None, None, self.group, stats).reshape(ep, n_local)
        send_splits = counts_E.reshape(ep, n_local).sum(1).tolist()
        recv_splits = recv_counts_SJ.sum(1).tolist()
        stats.rows_sent += sum(send_splits) - send_splits[self.rank]
        stats.rows_received += sum(recv_splits) - recv_splits[self.rank]
        # 2. dispatch rows and gate scores (routing is grouped by expert, so by destination rank).
        with record_function("dispatch"):
            rows_AD = x_TD.index_select(0, routing.token_index)
            recv_RD = _AllToAll.apply(rows_AD, recv_splits, send_splits, self.group, stats)
            recv_scores_R = _AllToAll.apply(routing.scores, recv_splits, send_splits, self.group, stats)
        # 3. local experts on contiguous expert-major segments of the received rows.
        order_R = expert_major_order(recv_counts_SJ)
        local = Routing(token_index=order_R, scores=recv_scores_R.index_select(0, order_R),
                        counts=recv_counts_SJ.sum(0))
        out_RD = routed_experts(recv_RD, local, w1_JDN, w2_JFD, activation, impl, b1=b1_JN, b2=b2_JD, float8=float8)
        # 4. combine: back to the senders, summed per token in float32 (expert order, as without EP).
        with record_function("combine"):
            back_AD = _AllToAll.apply(out_RD, send_splits, recv_splits, self.group, stats)
            acc = torch.float32 if x_TD.dtype in (torch.bfloat16, torch.float16) else x_TD.dtype
            out_TD = torch.zeros(x_TD.shape, dtype=acc, device=x_TD.device)
            return out_TD.index_add(0, routing.token_index, back_AD.to(acc)).to(x_TD.dtype)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [module for module in model.modules() if isinstance(module, MoE)]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> AllToAllStats:
    """Shard every MoE layer's experts over `ep_mesh` (dim 0) and route its tokens by all-to-all; in place.

    Works on a model on the meta device (the usual case: before FSDP and materialisation) or a
    materialised one (each rank keeps its own experts' values; nothing is communicated). Returns the
    stats object all layers record into.
    """
    stats = AllToAllStats()
    group = ep_mesh.get_group()
    for moe in moe_layers(model):
        if moe.cfg.n_experts % ep_mesh.size():
            raise ValueError(f"{moe.cfg.n_experts} experts cannot be split over {ep_mesh.size()} ranks")
        for name, weight in list(moe.experts.named_parameters(recurse=False)):
            if not _per_expert(weight, moe):
                continue
            sharded = distribute_tensor(weight.data, ep_mesh, [Shard(0)], src_data_rank=None)
            moe.experts.register_parameter(name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
        moe.expert_compute = ExpertParallelCompute(group, stats)
    return stats


def all_to_all_stats(model: nn.Module) -> AllToAllStats | None:
    """The all-to-all stats of an expert-parallel model, or None when it has no expert parallelism."""
    for moe in moe_layers(model):
        if isinstance(moe.expert_compute, ExpertParallelCompute):
            return moe.expert_compute.stats
    return None


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The routed-expert weights of every MoE layer split per expert (the parameters EP shards)."""
    return {p for moe in moe_layers(model) for p in moe.experts.parameters() if _per_expert(p, moe)}


def _per_expert(param: nn.Parameter, moe: MoE) -> bool:
    """One slice per expert. A LoRA adapter every expert shares ([1, ...]) is not: whole on every rank, it
    shards like the block's other weights, and FSDP's reduction over all data-parallel ranks (the EP ranks
    among them) sums what each rank's experts contributed to its gradient."""
    return param.shape[0] == moe.cfg.n_experts
