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

The tokens are split into `pipeline_chunks(group)` consecutive ranges (two on NCCL, one on gloo, where
the transfers share the compute's cores), each with its own dispatch and combine:

1. counts: each rank tells every EP peer how many of each chunk's assignments go to each of the peer's
   experts (one all-to-all of chunks x E integers, waited for: the split sizes follow from it).
2. dispatch: each chunk's assignment rows x[token] (grouped by expert, hence by destination rank) and
   their gate scores travel to the owning ranks (all-to-all with uneven splits). All are issued before
   the first wait, and the MoE's shared expert (`alongside`) runs while they travel.
3. local experts: a chunk's received rows, ordered expert-major, go through `experts.routed_experts`
   (the configured impl, memory-efficient by default) on contiguous segments, gates applied inside,
   as soon as that chunk has arrived: chunk c + 1's rows travel while chunk c computes.
4. combine: each chunk's results travel back by the reverse all-to-all, issued as soon as they exist
   (while the next chunk computes), and are summed per token in float32, in the same (expert) order
   as the single-process computation (a token's assignments all lie in one chunk).

Autograd runs through every all-to-all: the backward of an all-to-all is the all-to-all with the
splits swapped, issued by the node of the forward's wait and waited for by the node of its launch
(`_Launch`, `_Wait`), so the backward of whatever ran between them in the forward hides it
(docs/design/comm_overlap.md). Every local expert weight gets a gradient (zero when no token reached
it), so FSDP's reductions have the same layout on every rank, and a rank that receives no token still
takes part in every collective, in the same order as every other. `AllToAllStats` records the time
the rank spent blocked in the all-to-alls (the counts exchange and every wait, both directions: the
exposed part, not the time the bytes were in flight) and the rows exchanged, for the step metrics.
This module changes where and when expert compute runs, never what it computes (the chunks change
only how the expert GEMMs are cut, hence float rounding); it holds no optimizer, loss or data logic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
    """This rank's all-to-all cost since the last `take()`: seconds blocked in them (forward and backward,
    counts included; time in flight behind compute is not counted) and routed rows sent to / received from
    other ranks by the dispatches (the combines move the same rows back). Under activation checkpointing
    the recomputed forward moves them again."""

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


def _timed(stats: AllToAllStats, device: torch.device, call):
    """Run `call()` and add the time the calling thread (CUDA: the stream) spent in it to `stats`."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = call()
        end.record()
        stats._events.append((start, end))
        return out
    begin = time.perf_counter()
    out = call()
    stats.seconds += time.perf_counter() - begin
    return out


def _timed_all_to_all(x: Tensor, output_splits: list[int] | None, input_splits: list[int] | None,
                      group: dist.ProcessGroup, stats: AllToAllStats) -> Tensor:
    """all_to_all_single of `x` over `group`, waited for and timed into `stats` (no autograd)."""
    with record_function("all_to_all"):  # a label in profiler traces
        return _timed(stats, x.device, lambda: funcol.wait_tensor(
            funcol.all_to_all_single(x.contiguous(), output_splits, input_splits, group)))


class _InFlight:
    """One all-to-all between its launch and its wait: the forward's, then (reversed) the backward's.

    Holds the un-waited result of `funcol.all_to_all_single`; `_Launch` and `_Wait` pass it on, so the
    autograd nodes between them (the work issued in the meantime) run while the bytes travel.
    """

    __slots__ = ("forward", "backward")

    def __init__(self):
        self.forward: Tensor | None = None
        self.backward: Tensor | None = None


def _issue(x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    with record_function("all_to_all_launch"):
        return funcol.all_to_all_single(x.contiguous(), output_splits, input_splits, group)


def _wait(pending: Tensor, stats: AllToAllStats) -> Tensor:
    """The result of an issued all-to-all; only the time spent blocked here counts (the exposed part)."""
    with record_function("all_to_all_wait"):
        return _timed(stats, pending.device, lambda: funcol.wait_tensor(pending))


class _Launch(torch.autograd.Function):
    """Issues the all-to-all of `x` and returns an empty token; `_Wait` on that token returns the result.

    Backward runs in the opposite order: `_Wait`'s backward issues the reverse all-to-all of the
    gradient, and this node waits for it, so the backward nodes created between the two forward
    calls (the other chunk's experts, the shared expert) run while the gradient travels.
    """

    @staticmethod
    def forward(ctx, x: Tensor, flight: _InFlight, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup, stats: AllToAllStats) -> Tensor:  # noqa: D102
        ctx.flight, ctx.stats = flight, stats
        flight.forward = _issue(x, output_splits, input_splits, group)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad: Tensor):  # noqa: D102
        grad_in, ctx.flight.backward = _wait(ctx.flight.backward, ctx.stats), None
        return grad_in, None, None, None, None, None


class _Wait(torch.autograd.Function):
    """Waits for the all-to-all `_Launch` issued (see there); its backward issues the reverse one."""

    @staticmethod
    def forward(ctx, token: Tensor, flight: _InFlight, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup, stats: AllToAllStats) -> Tensor:  # noqa: D102
        ctx.flight, ctx.splits, ctx.group = flight, (output_splits, input_splits), group
        out, flight.forward = _wait(flight.forward, stats), None
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # noqa: D102
        output_splits, input_splits = ctx.splits
        ctx.flight.backward = _issue(grad_out, input_splits, output_splits, ctx.group)
        return grad_out.new_empty(0), None, None, None, None, None


@dataclass
class _ChunkPlan:
    """One token chunk's assignments and the split sizes of its all-to-alls (rows per EP peer)."""

    routing: Routing
    recv_counts_SJ: Tensor  # rows received [source rank, local expert]
    send_splits: list[int]
    recv_splits: list[int]


def split_routing(routing: Routing, n_tokens: int, chunks: int) -> list[Routing]:
    """The routing of `chunks` consecutive token ranges, each still grouped by expert (in the same order).

    A token's assignments all fall in its range, so summing each chunk's results per token adds the
    same terms in the same order as the whole routing does. Always `chunks` parts, empty ones included
    (fewer tokens than chunks, a rank without tokens): every EP rank must issue the same all-to-alls.
    """
    if chunks <= 1:
        return [routing]
    n_experts = routing.counts.numel()
    expert_of_row = torch.repeat_interleave(torch.arange(n_experts, device=routing.counts.device), routing.counts)
    bounds = torch.tensor([n_tokens * c // chunks for c in range(1, chunks)], device=routing.token_index.device)
    chunk_of_row = torch.bucketize(routing.token_index, bounds, right=True)
    parts = []
    for chunk in range(chunks):
        rows = (chunk_of_row == chunk).nonzero().squeeze(1)
        counts = torch.bincount(expert_of_row.index_select(0, rows), minlength=n_experts).to(routing.counts.dtype)
        parts.append(Routing(token_index=routing.token_index.index_select(0, rows),
                             scores=routing.scores.index_select(0, rows), counts=counts))
    return parts


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


# Token chunks pipelined through dispatch, local experts and combine: chunk c + 1's dispatch travels
# while chunk c's experts compute, chunk c's combine while chunk c + 1's do (and the reverse in backward).
# Two hide about half of the all-to-all time at the cost of expert GEMMs half as tall. Only where the
# transfers run beside the compute (NCCL: copy engines and NICs); gloo moves the bytes with threads on the
# compute's own cores, so there the halved GEMMs and the extra exchanges are pure cost: qwen3_moe_debug on
# 4 gloo ranks (idle, 2 cores) ran 0.87x the tokens/s with two chunks as with one (docs/results.md,
# "Communication overlap on idle cores (round 22)").
PIPELINE_CHUNKS = 2


def pipeline_chunks(group: dist.ProcessGroup) -> int:
    """How many token chunks an EP layer pipelines on `group`: 1 on gloo, `PIPELINE_CHUNKS` elsewhere."""
    return 1 if dist.get_backend(group) == "gloo" else PIPELINE_CHUNKS


class ExpertParallelCompute:
    """The MoE's expert computation under EP: dispatch, local experts, combine (see the module docstring).

    Same call contract as `experts.routed_experts`: (x [T, d], routing over all E experts, w1, w2,
    activation, impl) -> out [T, d]. `w1`/`w2` are the layer's (FSDP-unsharded) expert weights, DTensors
    sharded on dim 0 over the EP group, or this rank's local [E/ep, ...] slices. It also takes
    `alongside`, work that does not depend on the routed experts (the MoE's shared expert): it runs while
    the dispatches travel, and the call then returns (out, alongside's result).
    """

    runs_alongside = True  # MoE passes its shared expert as `alongside=` (model/moe.py)

    def __init__(self, group: dist.ProcessGroup, stats: AllToAllStats, chunks: int = PIPELINE_CHUNKS):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stats = stats
        self.chunks = chunks

    def __call__(self, x_TD: Tensor, routing: Routing, w1: Tensor, w2: Tensor, activation: str = "swiglu",
                 impl: str = "memory_efficient", b1: Tensor | None = None, b2: Tensor | None = None,
                 float8: bool = False, alongside: Callable[[], Tensor] | None = None) -> Tensor | tuple:
        w1_JDN, w2_JFD, b1_JN, b2_JD = (t.to_local() if isinstance(t, DTensor) else t for t in (w1, w2, b1, b2))
        n_local = w1_JDN.shape[0]
        if n_local * self.ep != routing.n_experts:
            raise ValueError(f"expert parallelism over {self.ep} ranks: {n_local} local experts per rank "
                             f"do not cover the routing's {routing.n_experts} experts")
        plans = self._exchange_counts(split_routing(routing, x_TD.shape[0], self.chunks), n_local)
        # Every chunk's dispatch is issued before the first wait; the shared expert runs while they travel.
        with record_function("dispatch"):
            dispatched = [(self._launch(x_TD.index_select(0, plan.routing.token_index), plan.recv_splits,
                                        plan.send_splits),
                           self._launch(plan.routing.scores, plan.recv_splits, plan.send_splits)) for plan in plans]
        beside = alongside() if alongside is not None else None
        combines = []
        for plan, (rows, scores) in zip(plans, dispatched, strict=True):
            recv_RD, recv_scores_R = (_Wait.apply(token, flight, plan.recv_splits, plan.send_splits, self.group,
                                                  self.stats) for token, flight in (rows, scores))
            # Local experts on contiguous expert-major segments of the received rows.
            order_R = expert_major_order(plan.recv_counts_SJ)
            local = Routing(token_index=order_R, scores=recv_scores_R.index_select(0, order_R),
                            counts=plan.recv_counts_SJ.sum(0))
            out_RD = routed_experts(recv_RD, local, w1_JDN, w2_JFD, activation, impl, b1=b1_JN, b2=b2_JD,
                                    float8=float8)
            combines.append(self._launch(out_RD, plan.send_splits, plan.recv_splits))
        # Combine: back to the senders, summed per token in float32 (expert order, as without EP).
        with record_function("combine"):
            acc = torch.float32 if x_TD.dtype in (torch.bfloat16, torch.float16) else x_TD.dtype
            out_TD = torch.zeros(x_TD.shape, dtype=acc, device=x_TD.device)
            for plan, (token, flight) in zip(plans, combines, strict=True):
                back_AD = _Wait.apply(token, flight, plan.send_splits, plan.recv_splits, self.group, self.stats)
                out_TD = out_TD.index_add(0, plan.routing.token_index, back_AD.to(acc))
        out_TD = out_TD.to(x_TD.dtype)
        return out_TD if alongside is None else (out_TD, beside)

    def _launch(self, x: Tensor, output_splits: list[int], input_splits: list[int]) -> tuple[Tensor, _InFlight]:
        flight = _InFlight()
        return _Launch.apply(x, flight, output_splits, input_splits, self.group, self.stats), flight

    def _exchange_counts(self, chunks: list[Routing], n_local: int) -> list[_ChunkPlan]:
        """Every chunk's split sizes, from one all-to-all of the per-expert counts (each rank tells every EP
        peer how many rows of each chunk go to each of the peer's experts)."""
        ep, n_chunks = self.ep, len(chunks)
        counts_CPJ = torch.stack([chunk.counts.to(torch.long) for chunk in chunks]).reshape(n_chunks, ep, n_local)
        received = _timed_all_to_all(counts_CPJ.transpose(0, 1).reshape(-1), None, None, self.group, self.stats)
        received_SCJ = received.reshape(ep, n_chunks, n_local)
        plans = []
        for index, chunk in enumerate(chunks):
            recv_counts_SJ = received_SCJ[:, index]
            send_splits = counts_CPJ[index].sum(1).tolist()
            recv_splits = recv_counts_SJ.sum(1).tolist()
            self.stats.rows_sent += sum(send_splits) - send_splits[self.rank]
            self.stats.rows_received += sum(recv_splits) - recv_splits[self.rank]
            plans.append(_ChunkPlan(chunk, recv_counts_SJ, send_splits, recv_splits))
        return plans


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
        moe.expert_compute = ExpertParallelCompute(group, stats, pipeline_chunks(group))
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
