"""Architecture features of the Qwen3-MoE / OLMoE families against independent references.

RoPE layouts: the "half" layout is the interleaved one after a fixed channel permutation.
QK-norm (per head, full width), free head_dim and clip_qkv against a float64 attention written
out by hand. Every-layer MoE, the routing-only pass, init of the new parameters and the
parameter/FLOP count with a free head width.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moetrain.commands.init_report import report_rows
from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.model.flops import count_params, flops_per_token
from moetrain.model.init import classify
from moetrain.model.layers import Attention, apply_rope, rope_cos_sin, rope_permutation
from moetrain.model.transformer import Transformer


def family_cfg(**overrides) -> ModelConfig:
    moe = MoEConfig(n_experts=4, top_k=2, expert_hidden=6, impl="loop")
    fields = dict(vocab_size=17, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=6, n_dense_layers=0,
                  max_seq_len=32, qk_norm="per_head", rope_layout="half", moe=moe)
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.mark.parametrize("head_dim", [2, 6, 128])
def test_half_layout_is_the_interleaved_layout_after_the_channel_permutation(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(2, 5, 3, head_dim, generator=gen, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(5).expand(2, 5) * 7, head_dim, 10000.0)
    perm = rope_permutation(head_dim)
    half = apply_rope(x, cos, sin, "half")
    interleaved = apply_rope(x[..., perm], cos, sin, "interleaved")
    torch.testing.assert_close(half[..., perm], interleaved, rtol=0, atol=0)
    # and it is Hugging Face's rotate_half formula: x * cos + rotate_half(x) * sin
    cos2, sin2 = torch.cat([cos, cos], -1).unsqueeze(-2), torch.cat([sin, sin], -1).unsqueeze(-2)
    rotate_half = torch.cat([-x[..., head_dim // 2:], x[..., : head_dim // 2]], -1)
    torch.testing.assert_close(half, x * cos2 + rotate_half * sin2, rtol=1e-12, atol=1e-12)


def reference_attention(attn: Attention, x: torch.Tensor, norm: str, clip: float | None) -> torch.Tensor:
    """Float64, written out: projections, RMSNorm (per head or over the full width), clip, RoPE, causal softmax."""
    batch, seq, _ = x.shape
    heads, kv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim

    def rms(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * weight

    q, k, v = x @ attn.wq.weight.T, x @ attn.wk.weight.T, x @ attn.wv.weight.T
    if norm == "full":
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q, k, v = q.view(batch, seq, heads, hd), k.view(batch, seq, kv, hd), v.view(batch, seq, kv, hd)
    if norm == "per_head":
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    if clip is not None:
        q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
    # the angles as the model computes them (float32, like transformers); the rotation in float64
    cos, sin = (t.double() for t in rope_cos_sin(torch.arange(seq), hd, 10000.0))
    cos, sin = torch.cat([cos] * 2, -1)[:, None], torch.cat([sin] * 2, -1)[:, None]

    def rope(t):
        return t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv, dim=2), v.repeat_interleave(heads // kv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(batch, seq, heads * hd)
    return out @ attn.wo.weight.T


@pytest.mark.parametrize("norm, clip", [("none", None), ("per_head", None), ("full", None), ("full", 0.4)])
def test_attention_with_free_head_dim_qk_norm_and_clip_matches_a_written_out_reference(norm, clip):
    cfg = family_cfg(qk_norm=norm, clip_qkv=clip)
    torch.manual_seed(0)
    attn = Attention(cfg).double()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.4 * torch.randn_like(p))
    assert attn.wq.weight.shape == (4 * 6, 16) and attn.wk.weight.shape == (2 * 6, 16)
    norm_shapes = {"per_head": ((6,), (6,)), "full": ((24,), (12,))}
    if norm in norm_shapes:
        assert (tuple(attn.q_norm.weight.shape), tuple(attn.k_norm.weight.shape)) == norm_shapes[norm]
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = attn(x, torch.arange(7).expand(2, 7), None)
    torch.testing.assert_close(got, reference_attention(attn, x, norm, clip), rtol=1e-10, atol=1e-10)


def test_every_layer_moe_with_untied_head_builds_and_trains():
    model = Transformer(family_cfg())
    assert all(layer.is_moe for layer in model.layers) and model.output.weight is not model.tok_embeddings.weight
    model.init_weights(seed=0)
    tokens = torch.randint(0, 17, (2, 9), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_routing_only_pass_counts_the_same_experts_and_skips_the_head():
    model = Transformer(family_cfg(n_layers=3, n_dense_layers=1))
    model.init_weights(seed=1)
    tokens = torch.randint(0, 17, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(tokens)
        full = model.tokens_per_expert().clone()
        calls = []
        handle = model.output.register_forward_hook(lambda *args: calls.append(1))
        assert model(tokens, until_last_moe=True) is None
        handle.remove()
    assert calls == [] and torch.equal(model.tokens_per_expert(), full)


def test_qk_norm_weights_are_norms_for_init_and_the_init_report():
    cfg = family_cfg(qk_norm="full")
    assert [s.kind for s in classify("layers.1.attention.q_norm.weight", cfg)] == ["norm"]
    model = Transformer(cfg)
    model.init_weights(seed=0, scheme="olmo-normal")
    assert torch.equal(model.layers[0].attention.k_norm.weight, torch.ones(12))
    rows = {row["name"]: row for row in report_rows(model, "olmo-normal")}
    assert rows["layers.0.attention.q_norm.weight"]["dist"] == "ones"


@pytest.mark.parametrize("overrides", [{}, {"qk_norm": "full"}, {"qk_norm": "none", "head_dim": 128},
                                       {"n_dense_layers": 1, "ffn_hidden": 10, "tie_embeddings": True}])
def test_parameter_and_flop_counts_with_a_free_head_width(overrides):
    cfg = family_cfg(**overrides)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    hd = cfg.attention_head_dim()
    attention_matmul = 16 * 4 * hd * 2 + 16 * 2 * hd * 2
    assert flops_per_token(cfg, seq_len=10) - flops_per_token(cfg, seq_len=0) == 12 * 2 * 4 * hd * 10
    assert count_params(cfg)["active_matmul"] >= cfg.n_layers * attention_matmul


@pytest.mark.parametrize("args, field", [
    (["--model.head_dim", "7"], "model.head_dim"),
    (["--model.clip_qkv", "0"], "model.clip_qkv"),
    (["--model.init_from", "DIR"], "model.init_from"),
    (["--model.moe.z_loss_coef", "-1"], "model.moe.z_loss_coef"),
    (["--model.n_heads", "5"], "model.n_heads"),
])
def test_bad_family_fields_are_refused_in_one_line(args, field):
    from moetrain.config.job import apply_overrides
    from moetrain.errors import ConfigError

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        apply_overrides(JobConfig(), args)
    # a free head_dim lifts the divisibility rule on n_heads
    apply_overrides(JobConfig(), ["--model.n_heads", "5", "--model.head_dim", "8"])
