"""The one-token decode step's own paths: few-assignment experts, RoPE as a matrix, the cache's decode mask.

Generation's decode steps take paths no training forward takes: routed experts with few assignments
run without the grouped layout (`experts._experts_few`), RoPE is applied as one matrix per row from
a table over the cache's slots or made per step (`layers.decode_rope_rotation`), and a one-token
step builds no causal mask. Each is checked against an independent reference: the per-expert loop
under autograd, `apply_partial_rope` itself, and the model's full forward of each row alone.
"""

import pytest
import torch

import moetrain.model.experts as experts_module
import moetrain.model.layers as layers_module
from moetrain.config import ModelConfig, MoEConfig
from moetrain.model.experts import FEW_ASSIGNMENTS, routed_experts
from moetrain.model.grouped_mm import ClampedSwiGLU
from moetrain.model.kv_cache import KVCache
from moetrain.model.layers import apply_partial_rope, rope_cos_sin, rope_rotation
from moetrain.model.routing import routing_from_topk
from moetrain.train.build import build_model

CLAMPED = ClampedSwiGLU(alpha=1.702, limit=0.6)


def expert_problem(tokens, activation, biases, n_experts=6, dim=10, inner=4, top_k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = inner if activation == "gelu" else 2 * inner
    x = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    w1 = torch.randn(n_experts, dim, width, generator=gen, dtype=torch.float64)
    w2 = torch.randn(n_experts, inner, dim, generator=gen, dtype=torch.float64)
    b1 = torch.randn(n_experts, width, generator=gen, dtype=torch.float64) if biases else None
    b2 = torch.randn(n_experts, dim, generator=gen, dtype=torch.float64) if biases else None
    scores, idx = torch.randn(tokens, n_experts, generator=gen, dtype=torch.float64).softmax(-1).topk(top_k)
    return x, routing_from_topk(idx, scores, n_experts), w1, w2, b1, b2


@pytest.mark.parametrize("tokens", [1, 3, FEW_ASSIGNMENTS // 2])
@pytest.mark.parametrize("activation", ["swiglu", "gelu", CLAMPED], ids=["swiglu", "gelu", "clamped"])
@pytest.mark.parametrize("biases", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("impl", ["memory_efficient", "grouped", "loop"])
def test_few_assignments_without_autograd_equal_the_per_expert_loop(tokens, activation, biases, impl, monkeypatch):
    x, routing, w1, w2, b1, b2 = expert_problem(tokens, activation, biases)
    with torch.enable_grad():  # the reference: the plain per-expert loop under autograd (not the few path)
        want = routed_experts(x, routing, w1.requires_grad_(), w2, activation, "loop", b1=b1, b2=b2).detach()
    w1.requires_grad_(False)
    calls = []
    real_few = experts_module._experts_few
    monkeypatch.setattr(experts_module, "_experts_few", lambda *a, **k: calls.append(1) or real_few(*a, **k))
    with torch.no_grad():
        got = routed_experts(x, routing, w1, w2, activation, impl, b1=b1, b2=b2)
    assert calls == [1]  # the few path ran
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_the_few_path_is_only_for_inference_with_few_assignments(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the few-assignment path ran")

    monkeypatch.setattr(experts_module, "_experts_few", refuse)
    x, routing, w1, w2, _, _ = expert_problem(FEW_ASSIGNMENTS // 2 + 1, "swiglu", False)  # 2 x that > FEW
    with torch.no_grad():
        routed_experts(x, routing, w1, w2, "swiglu", "memory_efficient")
    x, routing, w1, w2, _, _ = expert_problem(1, "swiglu", False)
    routed_experts(x, routing, w1.requires_grad_(), w2, "swiglu", "memory_efficient")  # autograd: grouped path
    with torch.no_grad():  # an explicit backend is a request for that path
        routed_experts(x, routing, w1, w2, "swiglu", "memory_efficient", backend="segment_loop")


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("rotary_dim", [8, 4], ids=["full", "partial"])
@pytest.mark.parametrize("yarn", [False, True], ids=["plain", "yarn"])
def test_rope_rotation_matrix_equals_apply_partial_rope(layout, rotary_dim, yarn):
    cfg = ModelConfig(vocab_size=8, dim=16, n_layers=1, n_heads=2, rope_scaling="yarn" if yarn else "none",
                      rope_yarn_factor=4.0, rope_yarn_original_max_seq_len=16)
    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor([[0, 3, 17], [5, 1, 40]])
    x = torch.randn(2, 3, 2, 8, generator=gen, dtype=torch.float64)  # [B, S, H, D]
    cos, sin = rope_cos_sin(positions, rotary_dim, 10000.0, cfg)
    want = apply_partial_rope(x, cos, sin, layout)
    rotation = rope_rotation(positions, 8, rotary_dim, 10000.0, cfg, layout, torch.float64)  # [B, S, D, D]
    got = torch.einsum("bshd,bsde->bshe", x, rotation)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert not torch.allclose(got, x)  # it rotated


def small_model(**overrides):
    moe = MoEConfig(n_experts=4, top_k=2, expert_hidden=16)
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=64,
                moe=moe, n_dense_layers=1, qk_norm="per_head", rope_layout="half", partial_rotary_factor=0.5)
    base.update(overrides)
    return build_model(ModelConfig(**base), seed=5, init_scheme="gpt2").to(torch.float64).eval()


@pytest.mark.parametrize("table", [True, False], ids=["slot-table", "per-step"])
@pytest.mark.parametrize("padded", [False, True], ids=["one-length", "left-padded"])
def test_decode_steps_equal_the_full_forward_of_each_row(table, padded, monkeypatch):
    if not table:  # a table over the slots would exceed the budget: the matrices are made per step
        monkeypatch.setattr(layers_module, "ROPE_TABLE_ELEMENTS", 0)
    model = small_model()
    prompts = [[1, 5, 9, 2, 7], [1, 7, 3]] if padded else [[1, 5, 9, 2, 7], [1, 7, 3, 30, 31]]
    longest = max(len(p) for p in prompts)
    pad = torch.tensor([longest - len(p) for p in prompts])
    cache = KVCache(len(model.layers), 2, longest + 4, pad=pad)
    extra = torch.tensor([[4, 20, 33, 8], [6, 6, 1, 50]])
    with torch.no_grad():
        model(torch.tensor([[p[0]] * (longest - len(p)) + p for p in prompts]), cache=cache)
        assert cache.padded == padded
        steps = []
        for i in range(4):
            steps.append(model(extra[:, i:i + 1], cache=cache)[:, 0])
            assert cache.mask is None if not padded else cache.mask.shape == (2, 1, 1, longest + i + 1)
        assert cache._per_cache if table else not cache._per_cache
        for b, prompt in enumerate(prompts):
            full = model(torch.tensor([prompt + extra[b].tolist()]))[0]
            for i in range(4):
                torch.testing.assert_close(steps[i][b], full[len(prompt) + i], atol=1e-10, rtol=0)


def test_dropping_rows_updates_the_decode_mask():
    """After the padded row leaves the batch the rest decode without a mask and still match their full forward."""
    model = small_model()
    prompts = [[1, 5, 9, 2, 7], [1, 7, 3]]
    cache = KVCache(len(model.layers), 2, 8, pad=torch.tensor([0, 2]))
    with torch.no_grad():
        model(torch.tensor([prompts[0], [1, 1] + prompts[1]]), cache=cache)
        first = model(torch.tensor([[4], [6]]), cache=cache)[:, 0]
        cache.keep_rows(torch.tensor([0]))
        assert not cache.padded
        second = model(torch.tensor([[20]]), cache=cache)[0, 0]
        assert cache.mask is None
        full = model(torch.tensor([prompts[0] + [4, 20]]))[0]
    torch.testing.assert_close(first[0], full[5], atol=1e-10, rtol=0)
    torch.testing.assert_close(second, full[6], atol=1e-10, rtol=0)
