"""The memory-efficient Function: what it saves for backward, its score gradient formula, partial
input gradients, and bfloat16 accuracy against a float64 reference on the same (rounded) inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.model.experts import routed_experts
from moetrain.model.moe_function import (
    ExpertChunk,
    MemoryEfficientExperts,
    _scale_rows,
    _swiglu_backward,
    memory_efficient_experts,
    plan_chunks,
)
from moetrain.model.routing import routing_from_topk

BF16_UNIT_ROUNDOFF = 2.0**-8  # bf16 keeps 8 significant bits: round-to-nearest relative error <= 2^-8


def make_problem(tokens, dim, inner, n_experts, top_k, activation, dtype, seed=0):
    """Inputs drawn in float64 and rounded once to `dtype`; routing fixed from float64 router scores."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * inner if activation == "swiglu" else inner
    x = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    w1 = torch.randn(n_experts, dim, width, generator=gen, dtype=torch.float64) * dim**-0.5
    w2 = torch.randn(n_experts, inner, dim, generator=gen, dtype=torch.float64) * inner**-0.5
    grad_out = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    scores, idx = torch.randn(tokens, n_experts, generator=gen, dtype=torch.float64).softmax(-1).topk(top_k)
    return [t.to(dtype) for t in (x, w1, w2, grad_out, scores)] + [idx]


def grads_of(impl, x, w1, w2, grad_out, scores, idx, activation, backend="segment_loop"):
    x, w1, w2, scores = (t.clone().requires_grad_() for t in (x, w1, w2, scores))
    routing = routing_from_topk(idx, scores, w1.shape[0])
    out = routed_experts(x, routing, w1, w2, activation, impl, backend=backend)
    return (out, *torch.autograd.grad(out, (x, scores, w1, w2), grad_out))


def rel_err(actual, expected):
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def test_saves_only_x_h_scores_indices_counts():
    tokens, dim, inner, n_experts, top_k = 24, 32, 8, 6, 3
    x, w1, w2, grad_out, scores, idx = make_problem(tokens, dim, inner, n_experts, top_k, "swiglu", torch.float32)
    x.requires_grad_()
    w1.requires_grad_()
    w2.requires_grad_()
    scores.requires_grad_()
    routing = routing_from_topk(idx, scores, n_experts)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        out = routed_experts(x, routing, w1, w2, "swiglu", "memory_efficient")
    assignments = tokens * top_k
    shapes = sorted(tuple(t.shape) for t in saved if t.data_ptr() not in (w1.data_ptr(), w2.data_ptr()))
    assert shapes == sorted([(tokens, dim), (assignments, 2 * inner), (assignments,), (assignments,), (n_experts,)])
    # X is saved as the caller's tensor (no copy), and nothing of size tokens*top_k x hidden is kept
    assert any(t.data_ptr() == x.data_ptr() for t in saved)
    assert all(t.numel() < assignments * dim for t in saved if t.data_ptr() not in (w1.data_ptr(), w2.data_ptr()))
    out.backward(grad_out)
    assert x.grad is not None


def test_score_gradient_is_inner_product_of_output_gradient_and_expert_output():
    """dS_a = <dO[t_a], Y_a> with Y_a = phi(x W1_e) W2_e, computed here directly (the Function
    computes it as <dO W2^T, A> without ever forming Y)."""
    x, w1, w2, grad_out, scores, idx = make_problem(13, 16, 8, 5, 2, "gelu", torch.float64)
    _, _, grad_scores, _, _ = grads_of("memory_efficient", x, w1, w2, grad_out, scores, idx, "gelu")
    routing = routing_from_topk(idx, scores, 5)
    expert_of = torch.repeat_interleave(torch.arange(5), routing.counts)
    want = torch.empty(routing.n_assignments, dtype=torch.float64)
    for a, (t, e) in enumerate(zip(routing.token_index.tolist(), expert_of.tolist(), strict=True)):
        y = F.gelu(x[t] @ w1[e]) @ w2[e]
        want[a] = grad_out[t] @ y
    # map each token's top-k slots to their assignment rows
    slot_grad = torch.zeros(13, 2, dtype=torch.float64)
    order = torch.argsort(idx.reshape(-1), stable=True)
    slot_grad.view(-1)[order] = want
    assert torch.allclose(grad_scores, slot_grad, rtol=1e-12, atol=1e-12)


def test_partial_input_gradients():
    x, w1, w2, grad_out, scores, idx = make_problem(10, 16, 8, 4, 2, "swiglu", torch.float64)
    _, gx, gs, gw1, gw2 = grads_of("loop", x, w1, w2, grad_out, scores, idx, "swiglu")
    routing = routing_from_topk(idx, scores, 4)
    # only the weights need gradients (e.g. a frozen embedding below the layer)
    w1_leaf, w2_leaf = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    out = routed_experts(x, routing, w1_leaf, w2_leaf, "swiglu", "memory_efficient")
    got_w1, got_w2 = torch.autograd.grad(out, (w1_leaf, w2_leaf), grad_out)
    assert torch.allclose(got_w1, gw1, rtol=1e-12) and torch.allclose(got_w2, gw2, rtol=1e-12)
    # only x needs a gradient
    x_leaf = x.clone().requires_grad_()
    (got_x,) = torch.autograd.grad(routed_experts(x_leaf, routing, w1, w2, "swiglu", "memory_efficient"), x_leaf,
                                   grad_out)
    assert torch.allclose(got_x, gx, rtol=1e-12)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("backend", ["segment_loop", "torch_grouped_mm"])
def test_bfloat16_error_bound(activation, backend):
    """bf16 bound, against float64 on the same bf16-rounded inputs (so only computation error counts).

    Every GEMM and reduction accumulates in float32 (CPU bf16 matmuls accumulate in fp32; the
    Function's dS and token scatter-adds are fp32), so the reduction length contributes only
    ~L * 2^-24, negligible here: the error is set by rounding intermediates to bf16. The longest
    chain (dX: H, A, dA', S dA', dH, dX rows, dX) rounds 7 times, each with relative error
    <= u = 2^-8, so 8u bounds every output and gradient elementwise to first order; norm-wise we
    also require the memory-efficient path to be no worse than the standard-autograd loop run in
    bf16 (1.25x its error, plus u/4 for independent rounding noise)."""
    problem = make_problem(48, 64, 32, 8, 4, activation, torch.bfloat16, seed=1)
    reference = grads_of("loop", *[t.double() if t.is_floating_point() else t for t in problem], activation)
    mem = grads_of("memory_efficient", *problem, activation, backend=backend)
    loop_bf16 = grads_of("loop", *problem, activation)
    for name, got, base, want in zip(("out", "x", "scores", "w1", "w2"), mem, loop_bf16, reference, strict=True):
        assert got.dtype == torch.bfloat16, name
        err, base_err = rel_err(got, want), rel_err(base, want)
        assert err <= 8 * BF16_UNIT_ROUNDOFF, (name, err)
        assert err <= 1.25 * base_err + BF16_UNIT_ROUNDOFF / 4, (name, err, base_err)


def test_function_returns_no_gradient_for_integer_metadata():
    x, w1, w2, grad_out, scores, idx = make_problem(5, 16, 8, 3, 2, "swiglu", torch.float64)
    routing = routing_from_topk(idx, scores.requires_grad_(), 3)
    out = MemoryEfficientExperts.apply(x, routing.scores, w1, w2, routing.token_index, routing.counts, "swiglu",
                                       "segment_loop", 0)
    (grad_scores,) = torch.autograd.grad(out, routing.scores, grad_out)
    assert grad_scores.shape == routing.scores.shape


def test_plan_chunks_covers_every_expert_and_row_once():
    counts = [3, 0, 5, 1, 0, 0, 4, 2]
    assert plan_chunks(None, 8, 15, 4) == [ExpertChunk(0, 8, 0, 15)]
    assert plan_chunks(counts, 8, 15, 4) == [ExpertChunk(0, 3, 0, 8), ExpertChunk(3, 7, 8, 13),
                                             ExpertChunk(7, 8, 13, 15)]
    per_expert = plan_chunks(counts, 8, 15, 0)
    # 0: one expert with rows per chunk (empty experts ride along with the next one)
    assert [(c.first_expert, c.end_expert) for c in per_expert] == [(0, 1), (1, 3), (3, 4), (4, 7), (7, 8)]
    assert plan_chunks(counts, 8, 15, 10**9) == [ExpertChunk(0, 8, 0, 15)]


@pytest.mark.parametrize("chunk_rows", [0, 7, 10**9])
def test_chunk_size_does_not_change_results(chunk_rows):
    x, w1, w2, grad_out, scores, idx = make_problem(20, 16, 8, 6, 3, "swiglu", torch.float64)
    want = grads_of("loop", x, w1, w2, grad_out, scores, idx, "swiglu")
    x, w1, w2, scores = (t.clone().requires_grad_() for t in (x, w1, w2, scores))
    out = memory_efficient_experts(x, routing_from_topk(idx, scores, 6), w1, w2, "swiglu", "segment_loop",
                                   chunk_rows=chunk_rows)
    got = (out, *torch.autograd.grad(out, (x, scores, w1, w2), grad_out))
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("rows_dtype, scores_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                      (torch.float32, torch.bfloat16), (torch.float16, torch.float16)])
def test_scale_rows_is_bitwise_the_float32_product_rounded_once(rows_dtype, scores_dtype):
    """The one-pass scaling must round exactly as multiplying in float32 and rounding once does."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(37, 61, generator=gen).to(rows_dtype)
    scores = torch.rand(37, generator=gen).to(scores_dtype)
    want = (rows.float() * scores.float().unsqueeze(1)).to(rows_dtype)
    assert torch.equal(_scale_rows(rows, scores), want)
    in_place = rows.clone()
    assert torch.equal(_scale_rows(in_place, scores, out=in_place), want) and torch.equal(in_place, want)


def _swiglu_backward_reference(hidden, grad_act_unscaled, scores):
    """dS, S*A and dH by float64 autograd through A = silu(gate) * up, the definition."""
    hidden = hidden.double().clone().requires_grad_()  # a new leaf: the input stays as it is
    gate, up = hidden.chunk(2, dim=-1)
    act = F.silu(gate) * up
    weighted = act * scores.double().unsqueeze(1)
    (grad_hidden,) = torch.autograd.grad(weighted, hidden, grad_act_unscaled.double())
    return (grad_act_unscaled.double() * act).sum(1), weighted.detach(), grad_hidden


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_swiglu_backward_matches_autograd(dtype):
    gen = torch.Generator().manual_seed(4)
    hidden = (torch.randn(50, 2 * 24, generator=gen, dtype=torch.float64) * 3).to(dtype)
    grad_act = torch.randn(50, 24, generator=gen, dtype=torch.float64).to(dtype)
    scores = torch.rand(50, generator=gen, dtype=torch.float64).to(dtype)
    grad_s, weighted, grad_hidden = _swiglu_backward(hidden, grad_act, scores, True, True, True)
    want = _swiglu_backward_reference(hidden, grad_act, scores)
    assert grad_s.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)  # the reduction stays float32
    assert weighted.dtype == grad_hidden.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2 * BF16_UNIT_ROUNDOFF}[dtype]
    for got, ref in zip((grad_s, weighted, grad_hidden), want, strict=True):
        assert rel_err(got, ref) <= tol
    # only what is asked for is computed
    assert _swiglu_backward(hidden, grad_act, scores, False, False, True)[:2] == (None, None)
    assert _swiglu_backward(hidden, grad_act, scores, True, False, False)[1:] == (None, None)


def test_backward_writes_no_gradient_for_the_saved_pre_activation():
    """H is an operator output only so it can be saved: its (zero) gradient must not be materialised."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w1, w2, grad_out, scores, idx = make_problem(32, 16, 8, 4, 2, "swiglu", torch.float32)
    x, w1, w2, scores = (t.requires_grad_() for t in (x, w1, w2, scores))
    out = routed_experts(x, routing_from_topk(idx, scores, 4), w1, w2, "swiglu", "memory_efficient")
    h_shape = (32 * 2, 2 * 8)

    class ZeroFills(TorchDispatchMode):
        shapes: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.fill_.Scalar, torch.ops.aten.zeros.default, torch.ops.aten.zero_.default,
                        torch.ops.aten.zeros_like.default, torch.ops.aten.new_zeros.default):
                ZeroFills.shapes.append(tuple(result.shape))
            return result

    with ZeroFills():
        out.backward(grad_out)
    assert h_shape not in ZeroFills.shapes
    assert x.grad is not None and w1.grad is not None
