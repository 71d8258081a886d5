"""The one-token decode step's own paths: few-assignment experts, RoPE as a matrix, the cache's decode mask.

Generation's decode steps take paths no training forward takes: an MoE layer with few tokens runs
its experts straight from the top-k choice (`experts.few_token_experts`), RoPE is applied as one matrix per row from
a table over the cache's slots or made per step (`layers.decode_rope_rotation`), and a one-token
step builds no causal mask. Each is checked against an independent reference: the per-expert loop
and the MoE layer's normal (grouped) forward, `apply_partial_rope` itself, and the model's full
forward of each row alone.
"""

import pytest
import torch

import moetrain.model.layers as layers_module
import moetrain.model.moe as moe_module
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.model.experts import FEW_ASSIGNMENTS, few_token_experts, routed_experts
from moetrain.model.grouped_mm import ClampedSwiGLU
from moetrain.model.kv_cache import KVCache
from moetrain.model.layers import apply_partial_rope, rope_cos_sin, rope_rotation
from moetrain.model.moe import MoE
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
    return x, idx, scores, w1, w2, b1, b2


@pytest.mark.parametrize("tokens", [1, 3, FEW_ASSIGNMENTS // 2])
@pytest.mark.parametrize("activation", ["swiglu", "gelu", CLAMPED], ids=["swiglu", "gelu", "clamped"])
@pytest.mark.parametrize("biases", [False, True], ids=["nobias", "bias"])
def test_few_token_experts_equal_the_per_expert_loop(tokens, activation, biases):
    x, idx, scores, w1, w2, b1, b2 = expert_problem(tokens, activation, biases)
    want = routed_experts(x, routing_from_topk(idx, scores, w1.shape[0]), w1, w2, activation, "loop", b1=b1, b2=b2)
    got = few_token_experts(x, idx, scores, w1, w2, activation, b1, b2)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


MOE_VARIANTS = {
    "qwen3-like": dict(),
    "deepseek-like": dict(score_func="sigmoid", load_balance="aux_free", n_group=2, topk_group=1, n_experts=8,
                          routed_scaling_factor=2.5, n_shared_experts=1, z_loss_coef=1e-3),
    "gpt-oss-like": dict(router_bias=True, expert_proj_bias=True, activation="clamped_swiglu", swiglu_limit=0.5,
                         renormalize=False),
    "qwen2-like": dict(n_shared_experts=1, shared_expert_hidden=24, shared_expert_gate=True,
                       aux_loss_scope="microbatch", impl="grouped"),
}


@pytest.mark.parametrize("variant", MOE_VARIANTS)
@pytest.mark.parametrize("tokens", [1, 4])
def test_a_moe_decode_step_equals_its_normal_forward(variant, tokens, monkeypatch):
    """Outputs, expert counts, balance loss and z-loss: the few-token path against the grouped one."""
    cfg = MoEConfig(**{"n_experts": 6, "top_k": 2, "expert_hidden": 12, **MOE_VARIANTS[variant]})
    moe = MoE(16, cfg).double()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * 0.3)
        moe.expert_bias.copy_(torch.randn(cfg.n_experts, generator=gen) * 0.1)
    moe.eval()
    x = torch.randn(1, tokens, 16, generator=gen, dtype=torch.float64)
    with torch.enable_grad():
        want = moe(x).detach()  # autograd on: the normal path
    want_counts, want_aux, want_z = moe.tokens_per_expert, moe.aux_loss, moe.router_z
    calls = []
    monkeypatch.setattr(moe_module, "few_token_experts", lambda *a, **k: calls.append(1) or few_token_experts(*a, **k))
    with torch.no_grad():
        got = moe(x)
    assert calls == [1]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert torch.equal(moe.tokens_per_expert, want_counts) and int(want_counts.sum()) == 2 * tokens
    torch.testing.assert_close(moe.aux_loss, want_aux.detach(), atol=1e-12, rtol=0)
    assert (moe.router_z is None) == (want_z is None)
    if want_z is not None:
        torch.testing.assert_close(moe.router_z, want_z.detach(), atol=1e-12, rtol=0)


def test_the_few_token_path_is_only_for_inference_on_few_local_tokens(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the few-token path ran")

    monkeypatch.setattr(moe_module, "few_token_experts", refuse)
    moe = MoE(8, MoEConfig(n_experts=4, top_k=2, expert_hidden=6))
    for param in moe.parameters():
        torch.nn.init.normal_(param.data)
    x = torch.randn(1, 1, 8)
    moe(x)  # autograd on
    with torch.no_grad():
        moe.train()
        moe(x)  # training mode (e.g. the routing pass counting a step's experts)
        moe.eval()
        moe(torch.randn(1, FEW_ASSIGNMENTS // 2 + 1, 8))  # too many tokens
        calls = []
        moe.expert_compute = lambda *a, **k: calls.append(1) or routed_experts(*a, **k)  # e.g. expert parallelism
        moe(x)
        assert calls == [1]


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
@pytest.mark.parametrize("step", [1, 2], ids=["one-token", "two-token"])  # two: a verify forward's few tokens
def test_decode_steps_equal_the_full_forward_of_each_row(table, padded, step, monkeypatch):
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
        for i in range(0, 4, step):
            steps += model(extra[:, i:i + step], cache=cache).unbind(1)
            assert cache.few
            if step == 1:
                assert cache.mask is None if not padded else cache.mask.shape == (2, 1, 1, longest + i + 1)
            else:  # causal within the few tokens: a slice of the cache's table (and the real slots)
                assert cache.mask.shape == ((2, 1, step, longest + i + step) if padded else (step, longest + i + step))
        assert any(key[0] == "rope" for key in cache._per_cache) == table
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


def test_a_forward_with_a_cache_records_no_balance_statistics():
    """Generation never reads them, so its MoE layers skip the counts, balance loss and z-loss; the same
    forward without a cache (e.g. the routing pass of a global-batch balance loss) still records them."""
    model = small_model()
    tokens = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        model(tokens)
        assert all(moe.tokens_per_expert is not None and moe.aux_loss is not None for moe in model.moe_layers())
        model(tokens[:, :1])  # one token, no cache: the few-token path, statistics as before
        assert all(int(moe.tokens_per_expert.sum()) == moe.cfg.top_k for moe in model.moe_layers())
        cache = KVCache(len(model.layers), 1, 6)
        model(tokens, cache=cache)
        model(tokens[:, :1], cache=cache)
    for moe in model.moe_layers():
        assert moe.tokens_per_expert is None and moe.aux_loss is None and moe.router_z is None
    assert model.tokens_per_expert() is None and float(model.aux_loss()) == 0.0


def test_few_token_experts_of_no_tokens_is_empty():
    x, idx, scores, w1, w2, _, _ = expert_problem(2, "swiglu", False)
    out = few_token_experts(x[:0], idx[:0], scores[:0], w1, w2, "swiglu")
    assert out.shape == (0, x.shape[1]) and out.dtype == x.dtype


PROJECTIONS = {
    "per-head-norm": dict(qk_norm="per_head"),
    "per-head-norm-one-kv-head-biased": dict(qk_norm="per_head", n_kv_heads=1, attention_bias="qkv"),
    "full-norm-clipped": dict(qk_norm="full", clip_qkv=0.3, n_kv_heads=4),
    "no-norm": dict(qk_norm="none"),
}


@pytest.mark.parametrize("variant", PROJECTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 1), (1, 3)])
def test_the_decode_projection_is_bit_identical_to_the_normal_one(variant, dtype, batch, seq, monkeypatch):
    """One GEMV over wq | wk | wv and one QK-norm over q's and k's heads give exactly `_project`'s q, k, v."""
    model = small_model(**PROJECTIONS[variant]).to(dtype)
    attention = model.layers[0].attention
    with torch.no_grad():
        for param in attention.parameters():  # norm weights and biases away from their init values
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1), dtype=dtype) * 0.5)
    fused = KVCache(1, batch, 4).layer(0)
    unfused = KVCache(1, batch, 4, copy_weights=False).layer(0)
    calls = []
    original = type(attention)._project
    monkeypatch.setattr(type(attention), "_project", lambda self, x: calls.append(1) or original(self, x))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(20):
            x = torch.randn(batch, seq, 32, generator=gen).to(dtype) * 3
            want = original(attention, x)
            got = attention._project_decode(x, fused)
            assert all(torch.equal(w, g) and w.shape == g.shape for w, g in zip(want, got, strict=True))
            assert not calls
            attention._project_decode(x, unfused)  # a sharded model's cache copies no weights: _project itself
            assert calls == [1]
            calls.clear()
    assert ("qkv", id(attention)) in fused.cache._per_cache and not unfused.cache._per_cache
