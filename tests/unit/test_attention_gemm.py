"""The GEMM attention (gemm_attention.GemmAttention), which `attend` takes on CPU below its size bound.

The reference (tests/attention_reference.py) is written independently of attention.py: scores q·k/√D in
float64, the "same document, causal, i - j < window" mask, the sink as one extra logit per head, dropped
before the value product. The GEMM path must match it in values and in the gradients of q, k, v and the
sinks (float32, 1e-5) under every plan that reaches it (causal, dense, segments, blocks), with
grouped-query heads and a value width other than the key width; it must agree with SDPA's kernels (the
path above the bound); in bf16 its error against the float64 reference must stay within the flash kernel's
own error scale; and the bound must route large calls and other dtypes to SDPA.
"""

import pytest
import torch

import moetrain.model.gemm_attention as gemm_attention
from attention_reference import ids_from_lengths, reference, run
from moetrain.model.attention import attend, plan_attention

# Documents shorter than, equal to and longer than the windows below; one row a single document.
ROWS = [[1, 15, 16, 17, 3, 40, 4], [96], [33, 2, 61]]
CASES = {"plain": (False, None), "sinks": (True, None), "window8": (False, 8), "window16+sinks": (True, 16)}


def inputs(batch, seq, heads=4, kv_heads=2, head_dim=8, value_dim=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    value_dim = value_dim or head_dim
    q = torch.randn(batch, seq, heads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, seq, kv_heads, value_dim, generator=gen, dtype=torch.float64)
    sinks = torch.randn(heads, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(batch, seq, heads, value_dim, generator=gen, dtype=torch.float64)
    return q, k, v, sinks, grad_out


@pytest.fixture
def gemm_calls(monkeypatch):
    """Counts the calls that reach the GEMM attention."""
    calls = []
    apply = gemm_attention.GemmAttention.apply

    def counting(*args):
        calls.append(args[0].shape)
        return apply(*args)

    monkeypatch.setattr(gemm_attention.GemmAttention, "apply", counting)
    return calls


def compare(got, want, rtol=1e-5, atol=1e-5):
    assert len(got) == len(want)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=False):
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("chunk", [128, 7], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("method", ["dense", "segments", "blocks", "auto"])
@pytest.mark.parametrize("kv_heads, value_dim", [(4, 8), (2, 8), (1, 8), (2, 5)], ids=["mha", "gqa", "mqa", "dv5"])
def test_gemm_path_matches_the_float64_reference(gemm_calls, monkeypatch, method, case, kv_heads, value_dim, chunk):
    """Chunk 128: one chunk per call (rows of 96); 7: several, uneven, inside blocks' key spans too."""
    monkeypatch.setattr(gemm_attention, "GEMM_ATTENTION_CHUNK", chunk)
    with_sinks, window = CASES[case]
    ids = ids_from_lengths(ROWS)
    q, k, v, sinks, grad_out = inputs(len(ROWS), sum(ROWS[0]), kv_heads=kv_heads, value_dim=value_dim)
    sinks = sinks if with_sinks else None
    want = run(lambda q, k, v, s: reference(q, k, v, ids, s, window), q, k, v, sinks, grad_out, torch.float64)
    got = run(lambda q, k, v, s: attend(q, k, v, plan_attention(ids, method), s, window), q, k, v, sinks,
              grad_out, torch.float32)
    assert gemm_calls, "the float32 CPU call did not take the GEMM attention"
    compare(got, want)


@pytest.mark.parametrize("chunk", [128, 16, 7], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("case", CASES)
def test_gemm_path_for_rows_without_documents(gemm_calls, monkeypatch, case, chunk):
    monkeypatch.setattr(gemm_attention, "GEMM_ATTENTION_CHUNK", chunk)
    with_sinks, window = CASES[case]
    q, k, v, sinks, grad_out = inputs(2, 80, heads=6, kv_heads=3)
    sinks = sinks if with_sinks else None
    want = run(lambda q, k, v, s: reference(q, k, v, None, s, window), q, k, v, sinks, grad_out, torch.float64)
    got = run(lambda q, k, v, s: attend(q, k, v, None, s, window), q, k, v, sinks, grad_out, torch.float32)
    assert gemm_calls
    compare(got, want)


@pytest.mark.parametrize("method", ["dense", "segments", "blocks"])
def test_gemm_path_agrees_with_sdpa(monkeypatch, method):
    """The same call below the bound (GEMMs) and with the bound at 0 (SDPA's kernels), float32."""
    ids = ids_from_lengths(ROWS)
    q, k, v, sinks, grad_out = inputs(len(ROWS), sum(ROWS[0]))
    results = []
    for bound in (gemm_attention.GEMM_ATTENTION_MAX_SCORES, 0):
        monkeypatch.setattr(gemm_attention, "GEMM_ATTENTION_MAX_SCORES", bound)
        results.append(run(lambda q, k, v, s: attend(q, k, v, plan_attention(ids, method), s, 8), q, k, v, sinks,
                           grad_out, torch.float32))
    compare(*results)


def test_bfloat16_error_within_the_flash_kernels_scale(monkeypatch):
    """bf16 inputs: the GEMM path's error against float64 (on the bf16-rounded inputs) is of the flash
    kernel's order; a path that rounded the softmax's sums or skipped the scale would be far off. Four
    query chunks, so dk and dv are accumulated over chunks."""
    monkeypatch.setattr(gemm_attention, "GEMM_ATTENTION_CHUNK", 64)
    seq = 256
    q, k, v, _, grad_out = inputs(2, seq, heads=8, kv_heads=4, head_dim=64, seed=3)
    q, k, v, grad_out = (t.to(torch.bfloat16).double() for t in (q, k, v, grad_out))  # exact in bf16
    want = run(lambda q, k, v, s: reference(q, k, v, None, None, None), q, k, v, None, grad_out, torch.float64)
    errors = {}
    for name, bound in (("gemm", gemm_attention.GEMM_ATTENTION_MAX_SCORES), ("flash", 0)):
        monkeypatch.setattr(gemm_attention, "GEMM_ATTENTION_MAX_SCORES", bound)
        got = run(lambda q, k, v, s: attend(q, k, v, None), q, k, v, None, grad_out, torch.bfloat16)
        errors[name] = [float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, want, strict=True)]
    for gemm_error, flash_error in zip(errors["gemm"], errors["flash"], strict=True):
        assert gemm_error <= 2 * flash_error + 2 ** -9, errors


def test_the_bound_routes_large_calls_and_other_dtypes_to_sdpa(gemm_calls, monkeypatch):
    q, k, v, _, _ = inputs(2, 32)
    batch, seq, heads, _ = q.shape
    monkeypatch.setattr(gemm_attention, "GEMM_ATTENTION_MAX_SCORES", batch * heads * seq * seq - 1)
    attend(q.float(), k.float(), v.float(), None)
    assert not gemm_calls, "a call above the bound took the GEMM attention"
    monkeypatch.setattr(gemm_attention, "GEMM_ATTENTION_MAX_SCORES", batch * heads * seq * seq)
    attend(q.float(), k.float(), v.float(), None)
    assert len(gemm_calls) == 1
    attend(q, k, v, None)  # float64 stays on SDPA
    assert len(gemm_calls) == 1


def test_saved_probabilities_are_what_the_memory_estimate_counts():
    """The chunks' probabilities are the largest thing the GEMM path saves; the estimate's per-query key
    count (memory_estimate.py) must equal what autograd really keeps, and be 0 where SDPA runs."""
    batch, seq, heads = 1, 512, 4
    q, k, v, _, _ = inputs(batch, seq, heads=heads, kv_heads=2, head_dim=8)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t
        return t

    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attend(*leaves, None)
    probs = sum(t.numel() for t in saved.values() if t.dim() == 3 and t.shape[-1] != 8)
    keys = gemm_attention.gemm_attention_saved_keys(batch, heads, seq, torch.float32)
    assert keys == (128 * 128 + 128 * 256 + 128 * 384 + 128 * 512) / 512  # 4 chunks of 128 queries
    assert probs == batch * heads * seq * keys
    assert gemm_attention.gemm_attention_saved_keys(batch, heads, seq, torch.float64) == 0
    assert gemm_attention.gemm_attention_saved_keys(batch, heads, seq, torch.float32, "cuda") == 0
    assert gemm_attention.gemm_attention_saved_keys(64, 64, 4096, torch.bfloat16) == 0  # above the size bound
