"""Expert biases and GPT-OSS's clamped SwiGLU in every routed-expert implementation.

The loop implementation (plain autograd) is the reference; the grouped and memory-efficient ones
(its hand-written backward included) must match it in values and in the gradients of x, the gate
scores, both weights and both biases. The clamp limit is small enough that both clamps cut off a
good share of the pre-activations, so the clamped branches and their zero gradients are exercised.
The memory-efficient backward is also checked by torch.autograd.gradcheck in float64.
"""

import pytest
import torch

from moetrain.model.experts import routed_experts
from moetrain.model.grouped_mm import ClampedSwiGLU, activation_backward, activation_forward
from moetrain.model.routing import routing_from_topk

CLAMPED = ClampedSwiGLU(alpha=1.702, limit=0.6)


def problem(activation, biases, dtype=torch.float64, tokens=20, dim=12, inner=5, n_experts=5, top_k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * inner if activation != "gelu" else inner
    x = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    w1 = torch.randn(n_experts, dim, width, generator=gen, dtype=torch.float64) * 0.5
    w2 = torch.randn(n_experts, inner, dim, generator=gen, dtype=torch.float64) * 0.5
    b1 = torch.randn(n_experts, width, generator=gen, dtype=torch.float64) if biases else None
    b2 = torch.randn(n_experts, dim, generator=gen, dtype=torch.float64) if biases else None
    scores, idx = torch.randn(tokens, n_experts, generator=gen, dtype=torch.float64).softmax(-1).topk(top_k)
    idx[0] = torch.arange(top_k)  # expert n_experts - 1 may get no token: empty experts must be fine too
    grad_out = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    cast = (lambda t: None if t is None else t.to(dtype))
    return [cast(t) for t in (x, scores, w1, w2, b1, b2, grad_out)] + [idx]


def values_and_grads(impl, activation, x, scores, w1, w2, b1, b2, grad_out, idx, backend=None):
    leaves = [t.detach().clone().requires_grad_() for t in (x, scores, w1, w2)]
    bias_leaves = [None if b is None else b.detach().clone().requires_grad_() for b in (b1, b2)]
    routing = routing_from_topk(idx, leaves[1], w1.shape[0])
    out = routed_experts(leaves[0], routing, leaves[2], leaves[3], activation, impl, backend=backend,
                         b1=bias_leaves[0], b2=bias_leaves[1])
    wrt = leaves + [b for b in bias_leaves if b is not None]
    return [out, *torch.autograd.grad(out, wrt, grad_out)]


@pytest.mark.parametrize("activation", ["swiglu", "gelu", CLAMPED], ids=["swiglu", "gelu", "clamped"])
@pytest.mark.parametrize("biases", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("impl, backend, dtype", [
    ("grouped", "segment_loop", torch.float64), ("memory_efficient", "segment_loop", torch.float64),
    ("grouped", "torch_grouped_mm", torch.float32), ("memory_efficient", "torch_grouped_mm", torch.float32),
], ids=["grouped-f64", "memeff-f64", "grouped-gmm-f32", "memeff-gmm-f32"])
def test_matches_the_loop_in_values_and_every_gradient(activation, biases, impl, backend, dtype):
    args = problem(activation, biases, dtype)
    want = values_and_grads("loop", activation, *args)
    got = values_and_grads(impl, activation, *args, backend=backend)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert len(got) == len(want) == (7 if biases else 5)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"output {i}")


def test_memory_efficient_backward_passes_gradcheck_with_biases_and_clamps():
    x, scores, w1, w2, b1, b2, _, idx = problem(CLAMPED, True, tokens=8, dim=4, inner=3, n_experts=3)
    routing = routing_from_topk(idx, scores, 3)

    def fn(x, scores, w1, w2, b1, b2):
        r = type(routing)(routing.token_index, scores.reshape(-1)[torch.argsort(idx.reshape(-1), stable=True)],
                          routing.counts)
        return routed_experts(x, r, w1, w2, CLAMPED, "memory_efficient", backend="segment_loop", b1=b1, b2=b2)

    inputs = [t.detach().clone().requires_grad_() for t in (x, scores, w1, w2, b1, b2)]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


def test_clamped_swiglu_is_gpt_oss_formula_and_clamps_engage():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(64, 10, generator=gen, dtype=torch.float64) * 2
    gate, up = h[:, :5], h[:, 5:]
    assert (gate > CLAMPED.limit).any() and (up.abs() > CLAMPED.limit).any()
    g = torch.minimum(gate, torch.tensor(CLAMPED.limit, dtype=h.dtype))
    want = (up.clamp(-CLAMPED.limit, CLAMPED.limit) + 1) * g * torch.sigmoid(CLAMPED.alpha * g)
    torch.testing.assert_close(activation_forward(h, CLAMPED), want, rtol=1e-15, atol=1e-15)
    # its hand-written derivative against autograd through the forward
    hr = h.clone().requires_grad_()
    grad_a = torch.randn(64, 5, generator=gen, dtype=torch.float64)
    (auto,) = torch.autograd.grad(activation_forward(hr, CLAMPED), hr, grad_a)
    torch.testing.assert_close(activation_backward(h, grad_a, CLAMPED), auto, rtol=1e-12, atol=1e-12)


def test_bias_shapes_are_checked():
    x, scores, w1, w2, b1, b2, _, idx = problem("swiglu", True)
    routing = routing_from_topk(idx, scores, w1.shape[0])
    with pytest.raises(ValueError, match="expert biases"):
        routed_experts(x, routing, w1, w2, "swiglu", "loop", b1=b1[:, :3], b2=b2)
