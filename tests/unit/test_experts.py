"""Routed experts: routing records, the three implementations against a dense float64 reference,
gradients of x / scores (through a real router) / w1 / w2, and the grouped GEMM stride-0 regression."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.errors import ModelError
from moetrain.model.experts import routed_experts
from moetrain.model.grouped_mm import CPU_GROUPED_MM_BACKEND, grouped_mm, grouped_mm_backend, grouped_mm_weight_grad
from moetrain.model.routing import Routing, routing_from_topk

IMPLS = ("loop", "grouped", "memory_efficient")
BACKENDS = ("segment_loop", "torch_grouped_mm")


def dense_reference(x, gates, w1, w2, activation):
    """Every expert on every token, weighted by a dense [T,E] gate matrix (zero where not routed).

    Independent of Routing's sort/grouping: it never looks at token_index or counts."""
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        h = x @ w1[e]
        if activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = F.gelu(h)
        out = out + gates[:, e : e + 1] * (a @ w2[e])
    return out


def make_weights(n_experts, dim, inner, activation, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * inner if activation == "swiglu" else inner
    w1 = (torch.randn(n_experts, dim, width, generator=gen, dtype=torch.float64) * dim**-0.5).to(dtype)
    w2 = (torch.randn(n_experts, inner, dim, generator=gen, dtype=torch.float64) * inner**-0.5).to(dtype)
    return w1.requires_grad_(), w2.requires_grad_()


def router_forward(x, router_w, top_k, score_func, renormalize, allowed_experts=None):
    """A small router: linear -> softmax|sigmoid -> top-k (optionally within a subset) -> renormalise."""
    logits = x @ router_w
    probs = logits.softmax(-1) if score_func == "softmax" else torch.sigmoid(logits)
    if allowed_experts is not None:  # force empty experts: the others can never be picked
        mask = torch.full_like(probs, float("-inf"))
        mask[:, allowed_experts] = 0
        top_idx = (probs.detach() + mask).topk(top_k, dim=-1).indices
    else:
        top_idx = probs.detach().topk(top_k, dim=-1).indices
    top_scores = probs.gather(1, top_idx)
    if renormalize:
        top_scores = top_scores / top_scores.sum(-1, keepdim=True)
    return top_idx, top_scores


def run_case(impl, backend, *, tokens, dim, inner, n_experts, top_k, activation, dtype, score_func="softmax",
             renormalize=True, allowed_experts=None, seed=0):
    """Output and gradients (x, router weight, w1, w2) of one implementation, from float64 master inputs."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, dim, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    router_w = torch.randn(dim, n_experts, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    grad_out = torch.randn(tokens, dim, generator=gen, dtype=torch.float64).to(dtype)
    w1, w2 = make_weights(n_experts, dim, inner, activation, dtype, seed)
    top_idx, top_scores = router_forward(x, router_w, top_k, score_func, renormalize, allowed_experts)
    if impl == "dense":
        gates = torch.zeros(tokens, n_experts, dtype=dtype).scatter(1, top_idx, top_scores)
        out = dense_reference(x, gates, w1, w2, activation)
    else:
        routing = routing_from_topk(top_idx, top_scores, n_experts)
        out = routed_experts(x, routing, w1, w2, activation, impl, backend=backend)
    grads = torch.autograd.grad(out, (x, router_w, w1, w2), grad_out)
    return (out, *grads)


def rel_err(actual, expected):
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300)).item()


NAMES = ("out", "grad_x", "grad_router", "grad_w1", "grad_w2")


def test_routing_from_topk_groups_by_expert_in_token_order():
    top_idx = torch.tensor([[2, 0], [0, 3], [2, 1], [3, 2]])
    top_scores = torch.arange(8, dtype=torch.float32).reshape(4, 2) / 10
    routing = routing_from_topk(top_idx, top_scores, n_experts=5)
    assert routing.counts.tolist() == [2, 1, 3, 2, 0]
    # independent reference: enumerate (expert, token) pairs in order
    pairs = sorted((int(e), t, float(top_scores[t, j])) for t in range(4) for j, e in enumerate(top_idx[t]))
    assert routing.token_index.tolist() == [t for _, t, _ in pairs]
    assert routing.scores.tolist() == pytest.approx([s for _, _, s in pairs])
    assert routing.n_experts == 5 and routing.n_assignments == 8


def test_routing_from_topk_rejects_bad_input():
    with pytest.raises(ValueError, match="expert indices"):
        routing_from_topk(torch.tensor([[0, 4]]), torch.ones(1, 2), n_experts=4)
    with pytest.raises(ValueError, match="must both be"):
        routing_from_topk(torch.tensor([0, 1]), torch.ones(2), n_experts=4)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_loop_reference_matches_dense_float64(activation):
    kwargs = dict(tokens=11, dim=8, inner=4, n_experts=5, top_k=2, activation=activation, dtype=torch.float64)
    got, want = run_case("loop", None, **kwargs), run_case("dense", None, **kwargs)
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert rel_err(a, b) < 1e-12, name


CASES = {
    # name: kwargs; dims are multiples of 4 floats so the torch_grouped_mm backend really runs _grouped_mm
    "swiglu-softmax-renorm": dict(tokens=29, dim=16, inner=8, n_experts=6, top_k=2, activation="swiglu"),
    "gelu-sigmoid-norenorm": dict(tokens=23, dim=16, inner=8, n_experts=5, top_k=3, activation="gelu",
                                  score_func="sigmoid", renormalize=False),
    "swiglu-sigmoid-renorm": dict(tokens=17, dim=16, inner=8, n_experts=4, top_k=2, activation="swiglu",
                                  score_func="sigmoid", renormalize=True),
    "swiglu-softmax-norenorm": dict(tokens=17, dim=16, inner=8, n_experts=4, top_k=1, activation="swiglu",
                                    renormalize=False),
    "empty-experts": dict(tokens=19, dim=16, inner=8, n_experts=7, top_k=2, activation="swiglu",
                          allowed_experts=[1, 4, 5]),
    "single-token": dict(tokens=1, dim=16, inner=8, n_experts=4, top_k=2, activation="swiglu"),
    "single-token-gelu": dict(tokens=1, dim=16, inner=8, n_experts=4, top_k=3, activation="gelu"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl", ["grouped", "memory_efficient"])
def test_gradients_match_loop_float64_and_float32(impl, backend, case):
    kwargs = CASES[case]
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        got = run_case(impl, backend, **kwargs, dtype=dtype)
        want = run_case("loop", None, **kwargs, dtype=dtype)
        for name, a, b in zip(NAMES, got, want, strict=True):
            assert a.dtype == dtype
            assert rel_err(a, b) < tol, (name, dtype)


def test_empty_experts_get_zero_weight_gradients():
    kwargs = CASES["empty-experts"]
    *_, grad_w1, grad_w2 = run_case("memory_efficient", "segment_loop", **kwargs, dtype=torch.float64)
    unused = [e for e in range(kwargs["n_experts"]) if e not in kwargs["allowed_experts"]]
    assert torch.count_nonzero(grad_w1[unused]) == 0 and torch.count_nonzero(grad_w2[unused]) == 0
    assert torch.count_nonzero(grad_w1[kwargs["allowed_experts"]]) > 0


def _stride0_operands():
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2])
    a = torch.randn(10, 16, generator=gen, requires_grad=True)
    b = torch.randn(4, 16, 8, generator=gen, requires_grad=True)
    return a, b, counts


def test_raw_grouped_mm_fails_on_stride0_gradient():
    """Reproduces torch's CPU `_grouped_mm` backward bug: `out.sum().backward()` hands it an
    expanded (stride-0) gradient and it raises "Invalid strides/sizes, got [0, 0]"."""
    a, b, counts = _stride0_operands()
    out = torch._grouped_mm(a, b, offs=torch.cumsum(counts, 0, dtype=torch.int32))
    try:
        out.sum().backward()
    except RuntimeError as err:
        assert "Invalid strides/sizes" in str(err)
        return
    pytest.xfail(f"torch {torch.__version__} no longer fails on a stride-0 gradient in _grouped_mm backward: "
                 "the bug is fixed; moetrain's contiguous-gradient guard is now redundant but harmless")


def test_moetrain_grouped_mm_is_immune_to_stride0_gradient(monkeypatch):
    calls = []
    real = torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    a, b, counts = _stride0_operands()
    grouped_mm(a, b, counts, "torch_grouped_mm").sum().backward()
    assert calls, "the torch_grouped_mm backend must really call torch._grouped_mm here"
    # d(sum(a_seg @ b_e))/da = row sums of b_e for every row of the segment; /db_e = column sums of a_seg
    starts = [0, 3, 3, 8]
    for e, (start, count) in enumerate(zip(starts, counts.tolist(), strict=True)):
        rows = slice(start, start + count)
        assert torch.allclose(a.grad[rows], b.detach()[e].sum(1).expand(count, 16))
        want_b = a.detach()[rows].sum(0, keepdim=True).t().expand(16, 8)
        assert torch.allclose(b.grad[e], want_b)


@pytest.mark.parametrize("impl", IMPLS)
def test_routed_experts_immune_to_stride0_gradient(impl, monkeypatch):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    kwargs = CASES["swiglu-softmax-renorm"]
    x = torch.randn(kwargs["tokens"], kwargs["dim"], requires_grad=True)
    w1, w2 = make_weights(kwargs["n_experts"], kwargs["dim"], kwargs["inner"], "swiglu", torch.float32)
    top_scores, top_idx = torch.rand(kwargs["tokens"], kwargs["n_experts"]).topk(2)
    routing = routing_from_topk(top_idx, top_scores, kwargs["n_experts"])
    routed_experts(x, routing, w1, w2, "swiglu", impl, backend="torch_grouped_mm").sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert bool(calls) == (impl != "loop")


def test_weight_grad_backends_agree_with_empty_groups():
    gen = torch.Generator().manual_seed(3)
    a, g = torch.randn(12, 16, generator=gen), torch.randn(12, 8, generator=gen)
    counts = torch.tensor([0, 5, 0, 7, 0])
    want = torch.stack([a[:0].t() @ g[:0], a[:5].t() @ g[:5], a[:0].t() @ g[:0], a[5:].t() @ g[5:],
                        torch.zeros(16, 8)])
    for backend in BACKENDS:
        assert torch.allclose(grouped_mm_weight_grad(a, g, counts, backend), want, atol=1e-5)


def test_grouped_mm_backend_choice():
    assert grouped_mm_backend(torch.device("cpu"), torch.float64) == "segment_loop"
    assert grouped_mm_backend(torch.device("cuda"), torch.bfloat16) == "torch_grouped_mm"
    for impl in ("grouped", "memory_efficient"):
        chosen = grouped_mm_backend(torch.device("cpu"), torch.float32, impl)
        assert chosen == CPU_GROUPED_MM_BACKEND[impl]
    # misaligned rows (3 floats = 12 bytes) fall back to the segment loop instead of failing
    a, b = torch.randn(4, 3), torch.randn(2, 3, 5)
    out = grouped_mm(a, b, torch.tensor([1, 3]), "torch_grouped_mm")
    assert torch.allclose(out, torch.cat([a[:1] @ b[0], a[1:] @ b[1]]))


def test_routed_experts_rejects_bad_arguments():
    x = torch.randn(3, 8)
    w1, w2 = make_weights(2, 8, 4, "swiglu", torch.float32)
    routing = routing_from_topk(torch.tensor([[0], [1], [1]]), torch.ones(3, 1), 2)
    with pytest.raises(ModelError, match="impl = 'fast'.*loop, grouped, memory_efficient"):
        routed_experts(x, routing, w1, w2, "swiglu", "fast")
    with pytest.raises(ModelError, match="activation = 'relu'"):
        routed_experts(x, routing, w1, w2, "relu", "loop")
    with pytest.raises(ModelError, match="backend = 'cuda'"):
        routed_experts(x, routing, w1, w2, "swiglu", "grouped", backend="cuda")
    with pytest.raises(ValueError, match="inconsistent expert shapes"):
        routed_experts(x, routing, w1, w2, "gelu", "loop")
    with pytest.raises(ValueError, match="routing has 3 experts"):
        bad = Routing(routing.token_index, routing.scores, torch.tensor([1, 2, 0]))
        routed_experts(x, bad, w1, w2, "swiglu", "loop")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_no_assignments_gives_zero_output_and_zero_not_none_gradients(impl, backend):
    """Token rounding can drop every assignment of a small batch; every weight must still get a
    (zero) gradient so sharded gradient reduction stays uniform across ranks."""
    x = torch.randn(5, 16, requires_grad=True)
    w1, w2 = make_weights(3, 16, 8, "swiglu", torch.float32)
    scores = torch.zeros(0, requires_grad=True)
    routing = Routing(torch.zeros(0, dtype=torch.long), scores, torch.zeros(3, dtype=torch.long))
    out = routed_experts(x, routing, w1, w2, "swiglu", impl, backend=backend)
    grads = torch.autograd.grad(out, (x, w1, w2, scores), torch.randn(5, 16))
    assert torch.count_nonzero(out) == 0
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in grads)
