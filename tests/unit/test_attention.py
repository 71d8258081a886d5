"""Document-masked attention methods against the dense-mask reference (values and gradients).

Every method must compute what SDPA over the [B, 1, S, S] "same document and causal" mask
computes: float32 to 1e-5, bf16 within the bound derived in `test_segments_in_bfloat16_*`.
"flex" has no CPU backward in torch 2.13, so on CPU only its forward is compared; the
CUDA-marked tests (skipped without a GPU) compare its forward and backward there.
"""

import pytest
import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.model.attention import (
    BLOCK_SIZE,
    SEGMENT_TILE,
    AttentionPlan,
    attend,
    block_layout,
    plan_attention,
    segment_layout,
)
from moetrain.model.transformer import Transformer


def ids_from_lengths(rows: list[list[int]], device="cpu") -> torch.Tensor:
    """[B, S] document ids from each row's document lengths (ids count from 0 in every row)."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]).to(device)


# Lengths around the tile (1, tile - 1, tile, tile + 1), a long document, and a row that is one document.
MIXED = [[1, 15, 16, 17, 3, 40, 4], [96], [33, 2, 61]]


def qkv(seq_rows, heads=4, kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch, seq = len(seq_rows), sum(seq_rows[0])
    shapes = ((batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim), (batch, seq, kv_heads, head_dim))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_() for s in shapes]


def values_and_grads(method, ids, q, k, v, grad_out):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v, plan_attention(ids, method))
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("method", ["segments", "blocks", "auto"])
@pytest.mark.parametrize("kv_heads, head_dim", [(4, 8), (2, 8), (1, 6)], ids=["mha", "gqa", "mqa-hd6"])
def test_method_matches_dense_mask_in_values_and_gradients(method, kv_heads, head_dim):
    ids = ids_from_lengths(MIXED)
    q, k, v = qkv(MIXED, kv_heads=kv_heads, head_dim=head_dim)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    got = values_and_grads(method, ids, q, k, v, grad_out)
    ref = values_and_grads("dense", ids, q, k, v, grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("block", [4, 8, 16, 32], ids=lambda b: f"block{b}")
def test_blocks_match_the_dense_mask_for_every_block_size(block):
    """Small blocks make documents span many key blocks (several groups, the gathers and the inverse
    order all used); 96 tokens is no multiple of 32, so the padding tail is exercised too."""
    ids = ids_from_lengths(MIXED)
    layout = block_layout(ids, block)
    assert len(layout.groups) > 1 and layout.padded_seq == -(-96 // block) * block
    q, k, v = qkv(MIXED)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    got = []
    for t in (q, k, v):
        t.grad = None
    out = attend(q, k, v, AttentionPlan("blocks", blocks=layout))
    out.backward(grad_out)
    got = (out.detach(), q.grad, k.grad, v.grad)
    ref = values_and_grads("dense", ids, q, k, v, grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_block_layout_spans_from_the_first_querys_document():
    rows = [[5, 19, 8], [32]]  # block 8: row 0 blocks start in documents starting at 0, 5, 5, 24
    layout = block_layout(ids_from_lengths(rows), 8)
    assert BLOCK_SIZE == 64
    key_blocks = {}
    for group in layout.groups:
        for index in group.query_index.tolist():
            key_blocks[index] = group.key_blocks
    # row 0: block 0 -> 1; block 1 (doc from 5, block 0) -> 2; block 2 -> 3; block 3 (doc from 24, block 3) -> 1
    # row 1 is one document: block i needs all i + 1 blocks
    assert [key_blocks[i] for i in range(8)] == [1, 2, 3, 1, 1, 2, 3, 4]
    assert layout.work() == sum(n * 8 * 8 for n in key_blocks.values())


def test_dense_mask_matches_a_loop_over_documents_in_float64():
    """The reference itself: each document attended alone with a causal mask, in float64."""
    ids = ids_from_lengths(MIXED)
    q, k, v = (t.detach().double() for t in qkv(MIXED))
    out = attend(q, k, v, plan_attention(ids, "dense"))
    for b, row in enumerate(MIXED):
        start = 0
        for length in row:
            sl = slice(start, start + length)
            one = attend(q[b:b + 1, sl], k[b:b + 1, sl], v[b:b + 1, sl], None)
            torch.testing.assert_close(out[b:b + 1, sl], one, rtol=1e-12, atol=1e-12)
            start += length


def test_segment_layout_pads_to_the_tile_groups_by_length_and_inverts():
    rows = [[1, 16, 17, 30], [20, 44]]
    ids = ids_from_lengths(rows)
    layout = segment_layout(ids)
    assert SEGMENT_TILE == 16
    assert layout.groups == [(2, 16), (3, 32), (1, 48)]  # 1,16 | 17,30,20 | 44
    assert layout.padded_work() == 2 * 16 ** 2 + 3 * 32 ** 2 + 48 ** 2
    flat = torch.arange(ids.numel())
    assert torch.equal(layout.gather[layout.scatter], flat)  # every token's slot holds that token
    # Documents never mix: every padded slot reads a token of its own document and row.
    doc_of = (ids + 100 * torch.arange(2).unsqueeze(1)).reshape(-1)
    slot_docs = doc_of[layout.gather].split([n * length for n, length in layout.groups])
    for (n, length), docs in zip(layout.groups, slot_docs, strict=True):
        assert (docs.view(n, length) == docs.view(n, length)[:, :1]).all()


def test_documents_with_the_same_id_in_consecutive_rows_stay_apart():
    """Row b's last document and row b+1's first both have id 0 under a constant-id row: no leak."""
    ids = torch.tensor([[0] * 8 + [1] * 8, [1] * 16])
    q, k, v = qkv([[16], [16]])
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    for method in ("segments", "blocks"):
        for a, b in zip(values_and_grads(method, ids, q, k, v, grad_out),
                        values_and_grads("dense", ids, q, k, v, grad_out), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_auto_resolves_by_the_documents():
    one_doc_rows = torch.zeros(2, 64, dtype=torch.long)
    assert plan_attention(one_doc_rows, "auto").method == "causal"
    assert plan_attention(None, "auto").method == "causal"
    assert plan_attention(ids_from_lengths([[8] * 8, [16] * 4]), "auto").method == "segments"
    # Two documents of 63 and 1 tokens: padded work 64² + 16² > SEGMENTS_PAY_OFF · 64²: the dense mask.
    assert plan_attention(ids_from_lengths([[63, 1]]), "auto").method == "dense"
    assert plan_attention(ids_from_lengths([[63, 1]]), "segments").method == "segments"
    with pytest.raises(ValueError, match="attention method"):
        plan_attention(one_doc_rows, "sparse")


def test_flex_forward_matches_dense_on_cpu_and_refuses_backward():
    ids = ids_from_lengths(MIXED)
    q, k, v = (t.detach() for t in qkv(MIXED))
    with torch.no_grad():
        got = attend(q, k, v, plan_attention(ids, "flex"))
        ref = attend(q, k, v, plan_attention(ids, "dense"))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="no backward on CPU"):
        attend(q.requires_grad_(), k, v, plan_attention(ids, "flex"))


def test_segments_in_bfloat16_within_the_rounding_bound():
    """bf16 error bound, checked against float64 for both the method and the dense reference.

    Inputs are bf16 numbers, so both methods start from the same exact values. SDPA accumulates
    in float32 (error ~ L · 2^-24, negligible for L ≤ 96 here); the error that matters is bf16
    rounding, unit roundoff u = 2^-8, of the probabilities before P·V (each term off by ≤ u·P·|v|,
    so ≤ u·max|v| in total) and of the output (≤ u·|o| ≤ u·max|v|, o being a convex combination).
    So each output element is within 2u·max|v| of the exact value; we allow 4u·max|v|.
    Gradients chain three such roundings (dP = dO·V, dS = P∘(dP − δ), dQ = dS·K): compared in
    relative Frobenius norm, where independent roundings give ~u·√3 and we allow 8u.
    """
    u = 2.0 ** -8
    ids = ids_from_lengths(MIXED)
    q, k, v = qkv(MIXED, head_dim=16, dtype=torch.bfloat16)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    exact = values_and_grads("dense", ids, *(t.double() for t in (q, k, v)), grad_out.double())
    for method in ("segments", "blocks", "dense"):
        got = values_and_grads(method, ids, q, k, v, grad_out)
        out_err = (got[0].double() - exact[0]).abs().max()
        assert out_err <= 4 * u * v.abs().max().double(), (method, out_err)
        for name, g, e in zip(("dq", "dk", "dv"), got[1:], exact[1:], strict=True):
            rel = (g.double() - e).norm() / e.norm()
            assert rel <= 8 * u, (method, name, rel)


def family_model(attention: str, dtype=torch.float32) -> Transformer:
    """Qwen3-like: GQA, free head width, per-head QK-norm, half-layout RoPE, every layer MoE."""
    moe = MoEConfig(n_experts=4, top_k=2, expert_hidden=16, impl="loop")
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, ffn_hidden=48,
                      n_dense_layers=0, max_seq_len=128, qk_norm="per_head", rope_layout="half",
                      attention=attention, moe=moe)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.init_weights(seed=0, scheme="gpt2")
    return model.to(dtype)


@pytest.mark.parametrize("method", ["segments", "blocks", "auto"])
def test_model_logits_and_parameter_gradients_match_the_dense_mask(method):
    ids = ids_from_lengths(MIXED)
    tokens = torch.randint(0, 64, ids.shape, generator=torch.Generator().manual_seed(0))
    results = []
    for attention in (method, "dense"):
        model = family_model(attention)
        logits = model(tokens, document_ids=ids)
        logits.square().mean().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (got, got_grads), (ref, ref_grads) = results
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_model_flex_forward_matches_the_dense_mask_on_cpu():
    ids = ids_from_lengths(MIXED)
    tokens = torch.randint(0, 64, ids.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = family_model("flex")(tokens, document_ids=ids)
        ref = family_model("dense")(tokens, document_ids=ids)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_plan_for_no_documents_is_plain_causal():
    q, k, v = (t.detach() for t in qkv([[20]]))
    ids = torch.zeros(1, 20, dtype=torch.long)
    torch.testing.assert_close(attend(q, k, v, AttentionPlan("causal")), attend(q, k, v, plan_attention(ids, "dense")),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["flex", "segments", "blocks", "auto"])
def test_cuda_method_matches_dense_mask_forward_and_backward(method, dtype):
    """On CUDA "auto" is flex (compiled); bf16 is held to the bound of the CPU bf16 test, vs float64."""
    rows = [[1, 15, 16, 17, 3, 40, 4, 32], [128], [33, 2, 61, 32]]  # 128 tokens: flex's default block
    ids = ids_from_lengths(rows, device="cuda")
    q, k, v = qkv(rows, head_dim=16, dtype=dtype, device="cuda")
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to("cuda", dtype)
    assert method != "auto" or plan_attention(ids, method).method == "flex"
    got = values_and_grads(method, ids, q, k, v, grad_out)
    if dtype == torch.float32:
        ref = values_and_grads("dense", ids, q, k, v, grad_out)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
        return
    u = 2.0 ** -8
    exact = values_and_grads("dense", ids, *(t.double() for t in (q, k, v)), grad_out.double())
    assert (got[0].double() - exact[0]).abs().max() <= 4 * u * v.abs().max().double()
    for name, g, e in zip(("dq", "dk", "dv"), got[1:], exact[1:], strict=True):
        assert (g.double() - e).norm() / e.norm() <= 8 * u, name
