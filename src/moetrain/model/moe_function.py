"""Memory-efficient routed-expert forward/backward (the SonicMoE algorithm, arXiv 2512.14080 Sec. 3.2).

Standard autograd through gather -> W1 -> phi -> W2 -> score-weighting -> scatter saves the
gathered input X_g and the expert outputs Y, both tokens*top_k x hidden. This Function saves only
X (tokens x hidden, not gathered), the pre-activation H (tokens*top_k x width of W1), the scores,
the token indices and the per-expert counts. Backward recomputes A = phi(H), gathers X and dO
again, and gets the router-score gradient as dS = <dO W2^T, A> = <dA', A> (never from Y):

    dA'  = dO[token] W2_e^T          dS = <dA', A>            dA = S dA'
    dH   = dA * phi'(H)              dW2_e = sum (S A)^T dO[token]
    dW1_e = sum X[token]^T dH        dX = scatter-add over assignments of dH W1_e^T

All GEMMs are grouped over contiguous expert segments (backend from `experts.grouped_mm_backend`).
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
        # The segment loop needs the counts on the host; read them once and reuse them in backward.
        counts_host = counts.tolist() if backend == "segment_loop" else None
        gathered = x.index_select(0, token_index)
        hidden = grouped_mm(gathered, w1, counts, backend, counts_host)
        del gathered  # a temporary: backward gathers X again instead of keeping N x d bytes alive
        # Scaling A (N x n) by S before W2 is cheaper than scaling Y (N x d), and equal by linearity.
        weighted_act = _scale_rows(activation_forward(hidden, activation), scores)
        out = _scatter_add_rows(grouped_mm(weighted_act, w2, counts, backend, counts_host), token_index, x.shape[0])
        ctx.save_for_backward(x, hidden, scores, token_index, counts, w1, w2)
        ctx.activation = activation
        ctx.backend = backend
        ctx.counts_host = counts_host
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # noqa: D102
        x, hidden, scores, token_index, counts, w1, w2 = ctx.saved_tensors
        activation, backend, counts_host = ctx.activation, ctx.backend, ctx.counts_host
        need_x, need_scores, need_w1, need_w2 = ctx.needs_input_grad[:4]
        # An expanded (stride-0) gradient, e.g. from out.sum(), would trip `_grouped_mm`; make it dense.
        grad_out = grad_out.contiguous()
        act = activation_forward(hidden, activation)  # recomputed from H, never saved
        grad_out_rows = grad_out.index_select(0, token_index)  # dO[token] per assignment, N x d
        # dA' = dO W2^T: W2^T is a transposed view, no copy.
        grad_act_unscaled = grouped_mm(grad_out_rows, w2.transpose(1, 2), counts, backend, counts_host)

        grad_scores = None
        if need_scores:
            acc = _accumulate_dtype(act.dtype)
            grad_scores = (grad_act_unscaled.to(acc) * act.to(acc)).sum(dim=1).to(scores.dtype)

        grad_w2 = None
        if need_w2:
            grad_w2 = grouped_mm_weight_grad(_scale_rows(act, scores), grad_out_rows, counts, backend, counts_host,
                                             out_dtype=w2.dtype)
        del grad_out_rows, act

        grad_x = grad_w1 = None
        if need_x or need_w1:
            grad_hidden = activation_backward(hidden, _scale_rows(grad_act_unscaled, scores), activation)
            del grad_act_unscaled
            if need_w1:
                gathered = x.index_select(0, token_index)
                grad_w1 = grouped_mm_weight_grad(gathered, grad_hidden, counts, backend, counts_host,
                                                 out_dtype=w1.dtype)
                del gathered
            if need_x:
                grad_rows = grouped_mm(grad_hidden, w1.transpose(1, 2), counts, backend, counts_host)
                grad_x = _scatter_add_rows(grad_rows, token_index, x.shape[0])
        return grad_x, grad_scores, grad_w1, grad_w2, None, None, None, None


def memory_efficient_experts(x: Tensor, routing: Routing, w1: Tensor, w2: Tensor, activation: str,
                             backend: Backend) -> Tensor:
    """Entry point used by `experts.routed_experts(impl="memory_efficient")` (shapes already checked)."""
    # Integer metadata must be contiguous int64 for index_select/index_add and the offsets cumsum.
    token_index = routing.token_index.to(torch.long).contiguous()
    counts = routing.counts.to(torch.long).contiguous()
    return MemoryEfficientExperts.apply(x.contiguous(), routing.scores.contiguous(), w1, w2, token_index, counts,
                                        activation, backend)
