"""Transformer: RoPE properties, document masking vs a loop over documents, GQA, meta build, training."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.model.attention import document_causal_mask
from moetrain.model.layers import apply_rope, positions_from_documents, rope_cos_sin
from moetrain.model.transformer import Transformer
from moetrain.train.build import build_model


def tiny_cfg(**overrides) -> ModelConfig:
    moe = MoEConfig(n_experts=4, top_k=2, expert_hidden=16, impl="loop")
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, n_dense_layers=1,
                max_seq_len=64, moe=moe)
    base.update(overrides)
    return ModelConfig(**base)


def build(cfg: ModelConfig, seed: int = 0, scheme: str = "gpt2") -> Transformer:
    return build_model(cfg, seed=seed, init_scheme=scheme)


def rope_matrix(position: int, head_dim: int, theta: float) -> torch.Tensor:
    """R with R @ v == rope(v) at `position`, obtained by rotating the basis vectors."""
    basis = torch.eye(head_dim).reshape(1, head_dim, 1, head_dim)  # head_dim "tokens" at one position
    cos, sin = rope_cos_sin(torch.full((1, head_dim), position), head_dim, theta)
    return apply_rope(basis, cos, sin).reshape(head_dim, head_dim).T.double()


def closed_form_rope(position: int, head_dim: int, theta: float) -> torch.Tensor:
    """Block-diagonal 2x2 rotations by position · theta^(-2j/head_dim), in float64."""
    rot = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    for j in range(head_dim // 2):
        angle = position * theta ** (-2 * j / head_dim)
        c, s = math.cos(angle), math.sin(angle)
        rot[2 * j:2 * j + 2, 2 * j:2 * j + 2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    return rot


@settings(max_examples=40, deadline=None, database=None)
@given(head_dim=st.sampled_from([2, 4, 8, 16, 32]), position=st.integers(0, 1024),
       theta=st.sampled_from([10000.0, 500000.0]))
def test_rope_is_an_orthogonal_pairwise_rotation(head_dim, position, theta):
    rot = rope_matrix(position, head_dim, theta)
    torch.testing.assert_close(rot @ rot.T, torch.eye(head_dim, dtype=torch.float64), atol=1e-5, rtol=0)
    assert torch.allclose(torch.linalg.eigvals(rot).abs(), torch.ones(head_dim, dtype=torch.float64), atol=1e-5)
    torch.testing.assert_close(rot, closed_form_rope(position, head_dim, theta), atol=2e-4, rtol=0)


@settings(max_examples=40, deadline=None, database=None)
@given(head_dim=st.sampled_from([4, 8, 16]), m=st.integers(0, 512), n=st.integers(0, 512),
       shift=st.integers(0, 512), seed=st.integers(0, 2**16))
def test_rope_score_depends_only_on_offset(head_dim, m, n, shift, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 2, 1, head_dim, generator=gen).unbind(0)

    def score(pq: int, pk: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([[pq, pk]]), head_dim, 10000.0)
        rq = apply_rope(q, cq, sq)[0, 0, 0]
        rk = apply_rope(k, cq, sq)[0, 1, 0]
        return float(rq @ rk)

    scale = float(q.norm() * k.norm())
    assert abs(score(m, n) - score(m + shift, n + shift)) <= 1e-3 * scale


def test_positions_restart_per_document_and_mask_is_block_causal():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    assert positions_from_documents(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    mask = document_causal_mask(docs)[0, 0]
    for i in range(8):
        for j in range(8):
            assert bool(mask[i, j]) == (docs[0, i] == docs[0, j] and j <= i)


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "moe"])
def test_document_masking_matches_a_loop_over_documents(dense):
    cfg = tiny_cfg(n_dense_layers=2 if dense else 1)
    model = build(cfg, seed=3).double()
    gen = torch.Generator().manual_seed(0)
    lengths = [[5, 9, 2, 8], [24]]
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)
    doc_ids = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths])
    with torch.no_grad():
        packed = model(tokens, document_ids=doc_ids)
        explicit = model(tokens, positions=positions_from_documents(doc_ids), document_ids=doc_ids)
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                alone = model(tokens[b:b + 1, start:start + n])
                torch.testing.assert_close(packed[b, start:start + n], alone[0], rtol=1e-10, atol=1e-10)
                start += n
    torch.testing.assert_close(packed, explicit, rtol=0, atol=0)
    # Without document ids, the second document of row 0 does see the first one.
    with torch.no_grad():
        causal = model(tokens)
    assert not torch.allclose(causal[0, 5:14], packed[0, 5:14])


def test_grouped_query_attention_equals_full_attention_with_repeated_kv_heads():
    gqa_cfg = tiny_cfg(n_dense_layers=2, n_kv_heads=2)
    full_cfg = tiny_cfg(n_dense_layers=2, n_kv_heads=None)
    gqa, full = build(gqa_cfg, seed=1).double(), build(full_cfg, seed=2).double()
    head_dim = gqa_cfg.dim // gqa_cfg.n_heads
    repeats = gqa_cfg.n_heads // gqa_cfg.n_kv_heads
    with torch.no_grad():
        for name, param in gqa.named_parameters():
            target = full.get_parameter(name)
            if name.endswith(("attention.wk.weight", "attention.wv.weight")):
                # kv head h serves query heads h*repeats ... h*repeats + repeats - 1
                param = param.reshape(gqa_cfg.n_kv_heads, head_dim, -1).repeat_interleave(repeats, 0)
                param = param.reshape(target.shape)
            target.copy_(param)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), full(tokens), rtol=1e-10, atol=1e-10)


def test_parameter_names_and_shapes_follow_torchtitan():
    cfg = tiny_cfg(n_layers=3, n_dense_layers=1, moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16,
                                                                n_shared_experts=1))
    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes["tok_embeddings.weight"] == (64, 32)
    assert shapes["layers.0.attention.wq.weight"] == (32, 32)
    assert shapes["layers.0.attention.wk.weight"] == (16, 32)  # 2 kv heads x head_dim 8
    assert shapes["layers.0.feed_forward.w1.weight"] == (48, 32)
    assert shapes["layers.0.feed_forward.w2.weight"] == (32, 48)
    assert shapes["layers.1.moe.router.weight"] == (4, 32)
    assert shapes["layers.1.moe.experts.w1"] == (4, 32, 32)  # [E, d, 2n]
    assert shapes["layers.1.moe.experts.w2"] == (4, 16, 32)  # [E, n, d]
    assert shapes["layers.2.moe.shared_expert.w3.weight"] == (16, 32)
    assert shapes["norm.weight"] == (32,) and shapes["output.weight"] == (64, 32)
    assert "layers.1.feed_forward.w1.weight" not in shapes and "layers.0.moe.router.weight" not in shapes
    assert all(p.is_meta for p in model.parameters())
    assert not any(name.endswith("bias") for name in shapes)


def test_tied_embeddings_share_one_tensor():
    model = build(tiny_cfg(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())


def test_bad_positions_or_document_ids_shape_is_rejected():
    model = build(tiny_cfg())
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="document_ids shape"):
        model(tokens, document_ids=torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="positions shape"):
        model(tokens, positions=torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "moe"])
def test_model_trains_on_random_tokens(dense):
    torch.manual_seed(0)
    cfg = tiny_cfg(n_dense_layers=2 if dense else 1,
                   moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, impl="memory_efficient"))
    model = build(cfg, scheme="llama")
    tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
        opt.zero_grad()
        (loss + model.aux_loss()).backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.7 * losses[0], losses
    if not dense:
        assert model.aux_loss().item() > 0
    else:
        assert model.aux_loss().item() == 0.0


def test_init_weights_materialises_a_meta_model_like_to_empty_then_init():
    cfg = tiny_cfg()
    with torch.device("meta"):
        model = Transformer(cfg)
    model.init_weights(seed=4, scheme="neox")
    reference = build(cfg, seed=4, scheme="neox")
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


def test_expert_load_bookkeeping_is_exposed_by_the_model():
    model = build(tiny_cfg(n_layers=3, n_dense_layers=1))
    assert model.tokens_per_expert() is None  # no forward yet
    model.train()
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens)
    load = model.tokens_per_expert()
    moes = model.moe_layers()
    assert load.shape == (2, 4) and not load.requires_grad
    assert torch.equal(load, torch.stack([m.tokens_per_expert for m in moes]))
    assert load.sum(dim=1).tolist() == [2 * 8 * 2] * 2  # tokens x top_k per MoE layer
    assert all(m.load_since_update.sum() > 0 for m in moes)
    model.discard_pending_expert_load()
    assert all(m.load_since_update.sum() == 0 for m in moes)
    assert build(tiny_cfg(n_layers=1, n_dense_layers=1)).tokens_per_expert() is None  # dense model
