"""Memory-efficient routed-expert forward/backward (the SonicMoE algorithm, arXiv 2512.14080 Sec. 3.2).

Standard autograd through gather -> W1 -> phi -> W2 -> score-weighting -> scatter saves the
gathered input X_g and the expert outputs Y, both tokens*top_k x hidden. This Function saves only
X (tokens x hidden, not gathered), the pre-activation H (tokens*top_k x width of W1), the scores,
the token indices and the per-expert counts. Backward recomputes A = phi(H), gathers X and dO
again, and gets the router-score gradient as dS = <dO W2^T, A> = <dA', A> (never from Y):

    dA'  = dO[token] W2_e^T          dS = <dA', A>            dA = S dA'
    dH   = dA * phi'(H)              dW2_e = sum (S A)^T dO[token]
    dW1_e = sum X[token]^T dH        dX = scatter-add over assignments of dH W1_e^T

With expert biases (H = X W1_e + b1_e, Y = A W2_e + b2_e) the score gradient gains <dO, b2_e>,
db2_e = sum S dO[token] and db1_e = sum dH over the expert's rows; nothing more is saved but the
expert of each row.

GEMMs run over contiguous expert segments with the backend from `grouped_mm.grouped_mm_backend`:
on accelerators one `torch._grouped_mm` call per projection over all experts; on CPU the experts
are processed in cache-sized chunks (gather, GEMMs, elementwise work and scatter per chunk), so
not even a transient tokens*top_k x hidden tensor is formed.
Reductions that feed a low-precision result (dS, the token scatter-adds) accumulate in float32.
The score gradient is returned to autograd, so it reaches the router through ordinary autograd.
The model calls the layer as the custom operator `torch.ops.moetrain.memory_efficient_experts`
(forward and backward each one opaque op: torch.compile traces around it without graph breaks,
selective activation checkpointing keeps its outputs); `MemoryEfficientExperts` is the same
computation as a plain autograd Function, kept as the pre-operator form that tests and the
benchmark compare against.
This module holds no parameters, makes no routing decisions and has no distributed code; the
caller's weights may be FSDP-unsharded tensors. It is called by `experts.routed_experts` and imports
only the kernels (grouped_mm.py, float8_grouped_mm.py) and the routing record (routing.py), never experts.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from moetrain.model.float8_grouped_mm import float8_grouped_mm, float8_grouped_mm_weight_grad
from moetrain.model.grouped_mm import (
    Activation,
    Backend,
    ClampedSwiGLU,
    activation_backward,
    activation_forward,
    grouped_mm,
    grouped_mm_weight_grad,
)
from moetrain.model.routing import Routing


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _scale_rows(rows: Tensor, scores: Tensor, out: Tensor | None = None) -> Tensor:
    """rows * scores[:, None], multiplied in the accumulate dtype and rounded once to rows' dtype.

    One pass, no float32 temporaries: ATen's CPU kernels for a bf16/fp16 product (and for a mixed
    product written to a low-precision result) compute each element in float32 and round once,
    which is bit for bit `(rows.float() * scores.float()).to(rows.dtype)` (tested) at a third of the
    memory traffic. `out` may be `rows` itself (in place).
    """
    return torch.mul(rows, scores.unsqueeze(1), out=rows.new_empty(rows.shape) if out is None else out)


def _weighted_activation(hidden: Tensor, scores: Tensor, activation: Activation) -> Tensor:
    """S * phi(H) rounded as `_scale_rows(activation_forward(H), S)` is, in fewer passes for SwiGLU."""
    if activation != "swiglu":
        return _scale_rows(activation_forward(hidden, activation), scores)
    gate, up = hidden.chunk(2, dim=-1)
    act = F.silu(gate)
    act.mul_(up)  # the same one rounding as `silu(gate) * up`, without a second temporary
    return _scale_rows(act, scores, out=act)


def _swiglu_backward(hidden: Tensor, grad_act_unscaled: Tensor, scores: Tensor, need_scores: bool,
                     need_weighted_act: bool, need_hidden: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The SwiGLU part of the backward, sharing one float32 sigmoid: (dS [R] float32, S·A for dW2, dH).

    With gate g, up u, dA' = dO W2^T and A = silu(g) u, all in float32 (the accumulate dtype):
    dS = <dA', A>, S·A (rounded once), dA = S dA', dH = [dA u silu'(g) | dA silu(g)] rounded once.
    The unfused path rounded A, S dA' and silu(g) to the low-precision dtype on the way; here only the
    results are rounded, so the values are at least as accurate (the bf16 error bound test).
    """
    acc = _accumulate_dtype(hidden.dtype)
    gate, up = hidden.to(acc).chunk(2, dim=-1)  # views of one float32 copy (no copy at all in float32)
    silu = F.silu(gate)
    grad_scores = weighted_act = grad_hidden = None
    if need_scores or need_weighted_act:
        act = silu * up
        if need_scores:
            grad_scores = (grad_act_unscaled.to(acc) * act).sum(dim=1)
        if need_weighted_act:
            weighted_act = _scale_rows(act, scores, out=hidden.new_empty(act.shape))
        del act
    if need_hidden:
        grad_act = grad_act_unscaled.to(acc) * scores.to(acc).unsqueeze(1)  # dA = S dA', unrounded
        grad_hidden = hidden.new_empty(hidden.shape)
        width = gate.shape[1]
        torch.mul(grad_act, silu, out=grad_hidden[:, width:])  # d up = dA silu(g)
        grad_act.mul_(up)  # dA u, in place
        torch.ops.aten.silu_backward.grad_input(grad_act, gate, grad_input=grad_hidden[:, :width])
    return grad_scores, weighted_act, grad_hidden


# On CPU the experts are processed in chunks of consecutive experts holding about this many routed
# rows: each chunk's gathered rows stay cache-resident while its GEMMs and elementwise ops use them
# (the CPU analogue of SonicMoE fusing the gather into the GEMM), and elementwise work is batched
# over a whole chunk rather than issued per expert. Chosen by measurement (docs/bench_moe.md).
CPU_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class ExpertChunk:
    """Experts [first_expert, end_expert) own rows [first_row, end_row) of the grouped layout."""

    first_expert: int
    end_expert: int
    first_row: int
    end_row: int


def plan_chunks(counts_host: list[int] | None, n_experts: int, n_rows: int, chunk_rows: int) -> list[ExpertChunk]:
    """Group consecutive experts until a chunk holds >= chunk_rows rows (0: one non-empty expert each).

    Without host counts (accelerators, where reading them would stall the stream) everything is
    one chunk: one grouped GEMM call per projection.
    """
    if counts_host is None:
        return [ExpertChunk(0, n_experts, 0, n_rows)]
    chunks, first_expert, first_row, row = [], 0, 0, 0
    for expert, count in enumerate(counts_host):
        row += count
        if row - first_row >= max(chunk_rows, 1) or expert == n_experts - 1:
            chunks.append(ExpertChunk(first_expert, expert + 1, first_row, row))
            first_expert, first_row = expert + 1, row
    return chunks


def expert_of_rows(counts: Tensor, n_rows: int) -> Tensor:
    """The expert owning each row of the grouped layout, [n_rows] (no host sync: the size is given)."""
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=n_rows)


def gemms(float8: bool):
    """(product, weight gradient) kernels: `grouped_mm`'s pair, or their float8 forms (train.float8's routed
    experts, torchao's rowwise grouped recipe: float8_grouped_mm.py); chunking and all else stay the same."""
    return (float8_grouped_mm, float8_grouped_mm_weight_grad) if float8 else (grouped_mm, grouped_mm_weight_grad)


def _chunk_slices(chunk: ExpertChunk, counts: Tensor, counts_host: list[int] | None
                  ) -> tuple[slice, slice, Tensor, list[int] | None]:
    """(its rows, its experts, their counts, their host counts) of one chunk of the plan."""
    experts = slice(chunk.first_expert, chunk.end_expert)
    return (slice(chunk.first_row, chunk.end_row), experts, counts[experts],
            None if counts_host is None else counts_host[experts])


def _bias_rows(counts: Tensor, token_index: Tensor, b1: Tensor | None, b2: Tensor | None) -> Tensor | None:
    """The expert of every routed row, which expert biases index; None when there is no bias."""
    return expert_of_rows(counts, token_index.numel()) if b1 is not None or b2 is not None else None


def _forward(x: Tensor, scores: Tensor, w1: Tensor, w2: Tensor, token_index: Tensor, counts: Tensor,
             b1: Tensor | None, b2: Tensor | None, activation: Activation, backend: Backend,
             chunk_rows: int, float8: bool = False) -> tuple[Tensor, Tensor, list[int] | None, list[ExpertChunk]]:
    """The forward pass: (out in x's dtype, H (with b1 added), the host counts, the chunk plan) for the backward."""
    # The segment loop needs the counts on the host: read them once, reuse them in backward.
    counts_host = counts.tolist() if backend == "segment_loop" else None
    chunks = plan_chunks(counts_host, counts.numel(), token_index.numel(), chunk_rows)
    acc = _accumulate_dtype(x.dtype)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    # One chunk writes H directly; several fill row slices of one preallocated H.
    hidden = x.new_empty(token_index.numel(), w1.shape[2]) if len(chunks) > 1 else None
    experts_of_rows = _bias_rows(counts, token_index, b1, b2)
    mm, _ = gemms(float8)
    for chunk in chunks:
        rows, experts, counts_c, counts_host_c = _chunk_slices(chunk, counts, counts_host)
        tokens = token_index[rows]
        # Gathered rows are a chunk-sized temporary; backward gathers X again rather than keep them.
        hidden_c = mm(x.index_select(0, tokens), w1[experts], counts_c, backend, counts_host_c,
                      out=None if hidden is None else hidden[rows])
        if b1 is not None:  # in place: H is saved with its bias
            hidden_c += b1.index_select(0, experts_of_rows[rows])
        # Scaling A (rows x n) by S before W2 is cheaper than scaling Y (rows x d), equal by linearity.
        weighted_act = _weighted_activation(hidden_c, scores[rows], activation)
        out_rows = mm(weighted_act, w2[experts], counts_c, backend, counts_host_c).to(acc)
        if b2 is not None:  # S · b2_e per row
            out_rows += _scale_rows(b2.index_select(0, experts_of_rows[rows]), scores[rows]).to(acc)
        out.index_add_(0, tokens, out_rows)
    hidden = hidden_c if hidden is None else hidden
    return out.to(x.dtype), hidden, counts_host, chunks


def _backward(grad_out: Tensor, x: Tensor, hidden: Tensor, scores: Tensor, token_index: Tensor, counts: Tensor,
              w1: Tensor, w2: Tensor, b1: Tensor | None, b2: Tensor | None, activation: Activation,
              backend: Backend, counts_host: list[int] | None, chunks: list[ExpertChunk],
              needs: tuple[bool, ...], float8: bool = False) -> tuple[Tensor | None, ...]:
    """The backward pass: (dX, dS, dW1, dW2, db1, db2), None where `needs` says that input takes no gradient."""
    need_x, need_scores, need_w1, need_w2, need_b1, need_b2 = needs
    need_b1, need_b2 = need_b1 and b1 is not None, need_b2 and b2 is not None
    # An expanded (stride-0) gradient, e.g. from out.sum(), would trip `_grouped_mm`; make it dense.
    grad_out = grad_out.contiguous()
    acc = _accumulate_dtype(x.dtype)
    grad_x = torch.zeros(x.shape, dtype=acc, device=x.device) if need_x else None
    grad_scores = torch.empty_like(scores) if need_scores else None
    # Every expert's slice is written (zeros for empty experts) by grouped_mm_weight_grad.
    grad_w1 = torch.empty_like(w1) if need_w1 else None
    grad_w2 = torch.empty_like(w2) if need_w2 else None
    grad_b1 = torch.zeros(b1.shape, dtype=acc, device=b1.device) if need_b1 else None
    grad_b2 = torch.zeros(b2.shape, dtype=acc, device=b2.device) if need_b2 else None
    experts_of_rows = _bias_rows(counts, token_index, b1, b2)
    mm, weight_grad = gemms(float8)
    for chunk in chunks:
        rows, experts, counts_c, counts_host_c = _chunk_slices(chunk, counts, counts_host)
        tokens, scores_c, hidden_c = token_index[rows], scores[rows], hidden[rows]
        grad_out_rows = grad_out.index_select(0, tokens)  # dO[token] per assignment
        # dA' = dO W2^T (a transposed view of W2, no copy)
        grad_act_unscaled = mm(grad_out_rows, w2[experts].transpose(1, 2), counts_c, backend, counts_host_c)
        expert_rows = None if experts_of_rows is None else experts_of_rows[rows]
        need_hidden = need_x or need_w1 or need_b1
        if activation == "swiglu":  # A recomputed from H (never saved), one float32 sigmoid for everything
            grad_s, weighted_act, grad_hidden = _swiglu_backward(hidden_c, grad_act_unscaled, scores_c, need_scores,
                                                                 need_w2, need_hidden)
        else:
            act = activation_forward(hidden_c, activation)  # recomputed from H, never saved
            grad_s = (grad_act_unscaled.to(acc) * act.to(acc)).sum(dim=1) if need_scores else None
            weighted_act = _scale_rows(act, scores_c) if need_w2 else None
            del act
            grad_hidden = (activation_backward(hidden_c, _scale_rows(grad_act_unscaled, scores_c), activation)
                           if need_hidden else None)
        del grad_act_unscaled
        if need_scores:  # dS = <dA', A> (+ <dO, b2_e>), reduced in float32 for low-precision inputs
            if b2 is not None:
                grad_s += (grad_out_rows.to(acc) * b2.index_select(0, expert_rows).to(acc)).sum(dim=1)
            grad_scores[rows] = grad_s.to(scores.dtype)
        if need_w2:  # dW2_e = (S A)^T dO
            weight_grad(weighted_act, grad_out_rows, counts_c, backend, counts_host_c, out=grad_w2[experts])
        if need_b2:  # db2_e = sum over the expert's rows of S dO
            grad_b2.index_add_(0, expert_rows, _scale_rows(grad_out_rows, scores_c).to(acc))
        del grad_out_rows, weighted_act
        if need_hidden:
            if need_b1:  # db1_e = sum over the expert's rows of dH
                grad_b1.index_add_(0, expert_rows, grad_hidden.to(acc))
            if need_w1:  # dW1_e = X[token]^T dH, X gathered again
                weight_grad(x.index_select(0, tokens), grad_hidden, counts_c, backend, counts_host_c,
                            out=grad_w1[experts])
            if need_x:  # dX = scatter-add of dH W1^T
                grad_rows = mm(grad_hidden, w1[experts].transpose(1, 2), counts_c, backend, counts_host_c)
                grad_x.index_add_(0, tokens, grad_rows.to(acc))
    if need_x:
        grad_x = grad_x.to(x.dtype)
    grad_b1 = None if grad_b1 is None else grad_b1.to(b1.dtype)
    grad_b2 = None if grad_b2 is None else grad_b2.to(b2.dtype)
    return grad_x, grad_scores, grad_w1, grad_w2, grad_b1, grad_b2


class MemoryEfficientExperts(torch.autograd.Function):
    """out = scatter_add_t( S * (phi(X[t] W1_e + b1_e) W2_e + b2_e) ), saving X, H, S, indices and counts only."""

    @staticmethod
    def forward(ctx, x: Tensor, scores: Tensor, w1: Tensor, w2: Tensor, token_index: Tensor, counts: Tensor,
                activation: Activation, backend: Backend, chunk_rows: int, b1: Tensor | None = None,
                b2: Tensor | None = None) -> Tensor:  # noqa: D102
        out, hidden, counts_host, chunks = _forward(x, scores, w1, w2, token_index, counts, b1, b2, activation,
                                                    backend, chunk_rows)
        ctx.save_for_backward(x, hidden, scores, token_index, counts, w1, w2, b1, b2)
        ctx.activation, ctx.backend, ctx.counts_host, ctx.chunks = activation, backend, counts_host, chunks
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # noqa: D102
        x, hidden, scores, token_index, counts, w1, w2, b1, b2 = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:4]) + tuple((*ctx.needs_input_grad, False, False)[9:11])
        gx, gs, gw1, gw2, gb1, gb2 = _backward(grad_out, x, hidden, scores, token_index, counts, w1, w2, b1, b2,
                                               ctx.activation, ctx.backend, ctx.counts_host, ctx.chunks, needs)
        grads = (gx, gs, gw1, gw2, None, None, None, None, None, gb1, gb2)
        return grads[:len(ctx.needs_input_grad)]


# The layer runs as one opaque operator per pass (forward, backward), eager and compiled alike:
# a compiled graph then holds no host read of the counts and no data-dependent chunk plan (inside
# the operator the eager code above runs unchanged: host counts, cache-sized chunks; its fake rule
# gives the output shapes, which depend only on the input shapes), and selective activation
# checkpointing (moetrain.parallel.parallelize) can keep its outputs as one op's instead of
# recomputing the GEMMs inside it. The backward recomputes the chunk plan from `counts`. An
# operator's arguments are tensors and plain values, so the activation travels as its name and
# the clamped SwiGLU's two constants.

def _activation_args(activation: Activation) -> tuple[str, float, float]:
    if isinstance(activation, ClampedSwiGLU):
        return "clamped_swiglu", activation.alpha, activation.limit
    return activation, 0.0, 0.0


def _activation_of(name: str, alpha: float, limit: float) -> Activation:
    return ClampedSwiGLU(alpha=alpha, limit=limit) if name == "clamped_swiglu" else name


@torch.library.custom_op("moetrain::memory_efficient_experts", mutates_args=())
def _experts_op(x: Tensor, scores: Tensor, w1: Tensor, w2: Tensor, token_index: Tensor, counts: Tensor,
                b1: Tensor | None, b2: Tensor | None, activation: str, alpha: float, limit: float, backend: str,
                chunk_rows: int, float8: bool) -> tuple[Tensor, Tensor]:
    out, hidden, _, _ = _forward(x, scores, w1, w2, token_index, counts, b1, b2,
                                 _activation_of(activation, alpha, limit), backend, chunk_rows, float8)
    return out, hidden


@_experts_op.register_fake
def _experts_op_fake(x, scores, w1, w2, token_index, counts, b1, b2, activation, alpha, limit, backend,
                     chunk_rows, float8):
    return x.new_empty(x.shape), x.new_empty(token_index.shape[0], w1.shape[2])


@torch.library.custom_op("moetrain::memory_efficient_experts_backward", mutates_args=())
def _experts_backward_op(grad_out: Tensor, x: Tensor, hidden: Tensor, scores: Tensor, token_index: Tensor,
                         counts: Tensor, w1: Tensor, w2: Tensor, b1: Tensor | None, b2: Tensor | None,
                         activation: str, alpha: float, limit: float, backend: str, chunk_rows: int,
                         needs: list[bool], float8: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    counts_host = counts.tolist() if backend == "segment_loop" else None
    chunks = plan_chunks(counts_host, counts.numel(), token_index.numel(), chunk_rows)
    grads = _backward(grad_out, x, hidden, scores, token_index, counts, w1, w2, b1, b2,
                      _activation_of(activation, alpha, limit), backend, counts_host, chunks, tuple(needs), float8)
    # An operator returns tensors only: an input that takes no gradient gets an empty one, dropped below.
    return tuple(x.new_empty(0) if grad is None else grad for grad in grads)


@_experts_backward_op.register_fake
def _experts_backward_op_fake(grad_out, x, hidden, scores, token_index, counts, w1, w2, b1, b2, activation, alpha,
                              limit, backend, chunk_rows, needs, float8):
    return tuple(torch.empty_like(t) if need and t is not None else x.new_empty(0)
                 for t, need in zip((x, scores, w1, w2, b1, b2), needs, strict=True))


def _experts_op_setup_context(ctx, inputs, output):
    x, scores, w1, w2, token_index, counts, b1, b2, activation, alpha, limit, backend, chunk_rows, float8 = inputs
    # H is an output only so that it can be saved; nothing downstream uses it, so its gradient is
    # None. Materialised, it would be a zero tokens*top_k x width tensor written every backward.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, output[1], scores, token_index, counts, w1, w2, b1, b2)
    ctx.args = (activation, alpha, limit, backend, chunk_rows)
    ctx.float8 = float8


def _experts_op_backward(ctx, grad_out, grad_hidden):
    # H is an internal output (saved for backward, never used downstream), so grad_hidden is None.
    x, hidden, scores, token_index, counts, w1, w2, b1, b2 = ctx.saved_tensors
    if grad_out is None:  # not materialised (see setup_context): the output took no gradient
        grad_out = torch.zeros_like(x)
    inputs_need = ctx.needs_input_grad
    needs = [inputs_need[0], inputs_need[1], inputs_need[2], inputs_need[3], inputs_need[6] and b1 is not None,
             inputs_need[7] and b2 is not None]
    grads = _experts_backward_op(grad_out, x, hidden, scores, token_index, counts, w1, w2, b1, b2, *ctx.args, needs,
                                 ctx.float8)
    gx, gs, gw1, gw2, gb1, gb2 = (grad if need else None for grad, need in zip(grads, needs, strict=True))
    return gx, gs, gw1, gw2, None, None, gb1, gb2, None, None, None, None, None, None


_experts_op.register_autograd(_experts_op_backward, setup_context=_experts_op_setup_context)
EXPERTS_OP = torch.ops.moetrain.memory_efficient_experts.default  # what selective checkpointing keeps


def memory_efficient_experts(x: Tensor, routing: Routing, w1: Tensor, w2: Tensor, activation: Activation,
                             backend: Backend, chunk_rows: int | None = None, b1: Tensor | None = None,
                             b2: Tensor | None = None, float8: bool = False) -> Tensor:
    """Entry point used by `experts.routed_experts(impl="memory_efficient")` (shapes already checked); `float8`: the
    GEMMs in torchao's rowwise float8 grouped recipe (`gemms`)."""
    # Integer metadata must be contiguous int64 for index_select/index_add and the offsets cumsum.
    token_index = routing.token_index.to(torch.long).contiguous()
    counts = routing.counts.to(torch.long).contiguous()
    out, _ = _experts_op(x.contiguous(), routing.scores.contiguous(), w1, w2, token_index, counts, b1, b2,
                         *_activation_args(activation), backend, CPU_CHUNK_ROWS if chunk_rows is None else chunk_rows,
                         float8)
    return out
