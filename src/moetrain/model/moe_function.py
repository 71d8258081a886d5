"""Memory-efficient routed-expert forward/backward (the SonicMoE algorithm, arXiv 2512.14080 Sec. 3.2).

Standard autograd through gather -> W1 -> phi -> W2 -> score-weighting -> scatter saves the
gathered input X_g and the expert outputs Y, both tokens*top_k x hidden. This Function saves only
X (tokens x hidden, not gathered), the pre-activation H (tokens*top_k x width of W1), the scores,
the token indices and the per-expert counts. Backward recomputes A = phi(H), gathers X and dO
again, and gets the router-score gradient as dS = <dO W2^T, A> = <dA', A> (never from Y):

    dA'  = dO[token] W2_e^T          dS = <dA', A>            dA = S dA'
    dH   = dA * phi'(H)              dW2_e = sum (S A)^T dO[token]
    dW1_e = sum X[token]^T dH        dX = scatter-add over assignments of dH W1_e^T

GEMMs run over contiguous expert segments, in one of two forms chosen by the backend
(`experts.grouped_mm_backend`): whole-tensor `torch._grouped_mm` calls (CUDA), or on CPU a
per-expert pipeline that gathers, multiplies and scatters one expert at a time.
Reductions that feed a low-precision result (dS, the token scatter-adds) accumulate in float32.
The score gradient is returned to autograd, so it reaches the router through ordinary autograd.
This module holds no parameters and no distributed code; the caller's weights may be FSDP-unsharded
tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from moetrain.model.experts import (
    Backend,
    Routing,
    activation_backward,
    activation_forward,
    grouped_mm,
    grouped_mm_weight_grad,
)

# Gradients of (x, scores, w1, w2); None where autograd did not ask for one.
Grads = tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _scatter_add_rows(rows: Tensor, token_index: Tensor, n_tokens: int) -> Tensor:
    acc = torch.zeros(n_tokens, rows.shape[1], dtype=_accumulate_dtype(rows.dtype), device=rows.device)
    # index_put_(accumulate=True) measured faster than index_add_ on CPU for N x d rows.
    acc.index_put_((token_index,), rows.to(acc.dtype), accumulate=True)
    return acc.to(rows.dtype)


def _scale_rows(rows: Tensor, scores: Tensor) -> Tensor:
    """rows * scores[:, None], multiplied in the accumulate dtype and rounded once to rows' dtype."""
    acc = _accumulate_dtype(rows.dtype)
    return (rows.to(acc) * scores.to(acc).unsqueeze(1)).to(rows.dtype)


class MemoryEfficientExperts(torch.autograd.Function):
    """out = scatter_add_t( S * phi(X[t] W1_e) W2_e ), saving X, H, S, indices and counts only."""

    @staticmethod
    def forward(ctx, x: Tensor, scores: Tensor, w1: Tensor, w2: Tensor, token_index: Tensor, counts: Tensor,
                activation: str, backend: Backend) -> Tensor:  # noqa: D102
        if backend == "segment_loop":
            # Host copy of the counts, read once and reused by backward.
            ctx.counts_host = counts.tolist()
            out, hidden = _forward_per_expert(x, scores, w1, w2, token_index, ctx.counts_host, activation)
        else:
            ctx.counts_host = None
            out, hidden = _forward_grouped(x, scores, w1, w2, token_index, counts, activation, backend)
        ctx.save_for_backward(x, hidden, scores, token_index, counts, w1, w2)
        ctx.activation = activation
        ctx.backend = backend
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # noqa: D102
        x, hidden, scores, token_index, counts, w1, w2 = ctx.saved_tensors
        # An expanded (stride-0) gradient, e.g. from out.sum(), would trip `_grouped_mm`; make it dense.
        grad_out = grad_out.contiguous()
        needs = ctx.needs_input_grad[:4]
        if ctx.backend == "segment_loop":
            grads = _backward_per_expert(grad_out, x, hidden, scores, token_index, ctx.counts_host, w1, w2,
                                         ctx.activation, needs)
        else:
            grads = _backward_grouped(grad_out, x, hidden, scores, token_index, counts, w1, w2, ctx.activation,
                                      ctx.backend, needs)
        return (*grads, None, None, None, None)


# ---------------------------------------------------------------------------------------------
# Whole-tensor form: one grouped GEMM call per projection (`torch._grouped_mm`, e.g. on CUDA).
# The gathered N x d operands exist only as temporaries inside forward or backward.
# ---------------------------------------------------------------------------------------------

def _forward_grouped(x: Tensor, scores: Tensor, w1: Tensor, w2: Tensor, token_index: Tensor, counts: Tensor,
                     activation: str, backend: Backend) -> tuple[Tensor, Tensor]:
    gathered = x.index_select(0, token_index)
    hidden = grouped_mm(gathered, w1, counts, backend)
    del gathered  # backward gathers X again instead of keeping N x d bytes alive
    # Scaling A (N x n) by S before W2 is cheaper than scaling Y (N x d), and equal by linearity.
    weighted_act = _scale_rows(activation_forward(hidden, activation), scores)
    out = _scatter_add_rows(grouped_mm(weighted_act, w2, counts, backend), token_index, x.shape[0])
    return out, hidden


def _backward_grouped(grad_out: Tensor, x: Tensor, hidden: Tensor, scores: Tensor, token_index: Tensor, counts: Tensor,
                      w1: Tensor, w2: Tensor, activation: str, backend: Backend, needs: tuple[bool, ...]) -> Grads:
    need_x, need_scores, need_w1, need_w2 = needs
    act = activation_forward(hidden, activation)  # recomputed from H, never saved
    grad_out_rows = grad_out.index_select(0, token_index)  # dO[token] per assignment, N x d
    # dA' = dO W2^T: W2^T is a transposed view, no copy.
    grad_act_unscaled = grouped_mm(grad_out_rows, w2.transpose(1, 2), counts, backend)
    grad_scores = grad_w1 = grad_w2 = grad_x = None
    if need_scores:
        acc = _accumulate_dtype(act.dtype)
        grad_scores = (grad_act_unscaled.to(acc) * act.to(acc)).sum(dim=1).to(scores.dtype)
    if need_w2:
        grad_w2 = grouped_mm_weight_grad(_scale_rows(act, scores), grad_out_rows, counts, backend, out_dtype=w2.dtype)
    del grad_out_rows, act
    if need_x or need_w1:
        grad_hidden = activation_backward(hidden, _scale_rows(grad_act_unscaled, scores), activation)
        del grad_act_unscaled
        if need_w1:
            grad_w1 = grouped_mm_weight_grad(x.index_select(0, token_index), grad_hidden, counts, backend,
                                             out_dtype=w1.dtype)
        if need_x:
            grad_rows = grouped_mm(grad_hidden, w1.transpose(1, 2), counts, backend)
            grad_x = _scatter_add_rows(grad_rows, token_index, x.shape[0])
    return grad_x, grad_scores, grad_w1, grad_w2


# ---------------------------------------------------------------------------------------------
# Per-expert form (CPU segment loop): gather, GEMMs and scatter one expert at a time, so every
# gathered block is small (N_e x d) and used while still in cache -- the CPU analogue of
# SonicMoE fusing the gather into the GEMM. No N x d tensor exists even transiently.
# ---------------------------------------------------------------------------------------------

def _forward_per_expert(x: Tensor, scores: Tensor, w1: Tensor, w2: Tensor, token_index: Tensor, counts_host: list[int],
                        activation: str) -> tuple[Tensor, Tensor]:
    acc = _accumulate_dtype(x.dtype)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=acc, device=x.device)
    width = w1.shape[2]
    hidden = x.new_empty(token_index.shape[0], width)
    for tokens, s_e, w1_e, w2_e, hidden_e in zip(token_index.split(counts_host), scores.split(counts_host),
                                                 w1.unbind(0), w2.unbind(0), hidden.split(counts_host), strict=True):
        if tokens.numel() == 0:
            continue
        torch.mm(x.index_select(0, tokens), w1_e, out=hidden_e)
        weighted_act = _scale_rows(activation_forward(hidden_e, activation), s_e)
        out.index_add_(0, tokens, (weighted_act @ w2_e).to(acc))
    return out.to(x.dtype), hidden


def _backward_per_expert(grad_out: Tensor, x: Tensor, hidden: Tensor, scores: Tensor, token_index: Tensor,
                         counts_host: list[int], w1: Tensor, w2: Tensor, activation: str,
                         needs: tuple[bool, ...]) -> Grads:
    need_x, need_scores, need_w1, need_w2 = needs
    acc = _accumulate_dtype(x.dtype)
    grad_x = torch.zeros(x.shape[0], x.shape[1], dtype=acc, device=x.device) if need_x else None
    grad_scores = torch.zeros_like(scores) if need_scores else None
    grad_w1 = torch.zeros_like(w1) if need_w1 else None
    grad_w2 = torch.zeros_like(w2) if need_w2 else None
    start = 0
    for e, (tokens, s_e, hidden_e) in enumerate(zip(token_index.split(counts_host), scores.split(counts_host),
                                                    hidden.split(counts_host), strict=True)):
        rows = slice(start, start + tokens.numel())
        start = rows.stop
        if tokens.numel() == 0:
            continue
        grad_out_e = grad_out.index_select(0, tokens)
        grad_act_unscaled = grad_out_e @ w2[e].t()  # dA' = dO W2^T
        act = activation_forward(hidden_e, activation)  # recomputed from H
        if need_scores:
            grad_scores[rows] = (grad_act_unscaled.to(acc) * act.to(acc)).sum(dim=1).to(scores.dtype)
        if need_w2:
            torch.mm(_scale_rows(act, s_e).t(), grad_out_e, out=grad_w2[e])
        if need_x or need_w1:
            grad_hidden = activation_backward(hidden_e, _scale_rows(grad_act_unscaled, s_e), activation)
            if need_w1:
                torch.mm(x.index_select(0, tokens).t(), grad_hidden, out=grad_w1[e])
            if need_x:
                grad_x.index_add_(0, tokens, (grad_hidden @ w1[e].t()).to(acc))
    return (grad_x.to(x.dtype) if need_x else None), grad_scores, grad_w1, grad_w2


def memory_efficient_experts(x: Tensor, routing: Routing, w1: Tensor, w2: Tensor, activation: str,
                             backend: Backend) -> Tensor:
    """Entry point used by `experts.routed_experts(impl="memory_efficient")` (shapes already checked)."""
    # Integer metadata must be contiguous int64 for index_select/index_add and the offsets cumsum.
    token_index = routing.token_index.to(torch.long).contiguous()
    counts = routing.counts.to(torch.long).contiguous()
    return MemoryEfficientExperts.apply(x.contiguous(), routing.scores.contiguous(), w1, w2, token_index, counts,
                                        activation, backend)
