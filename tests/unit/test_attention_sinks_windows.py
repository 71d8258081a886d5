"""Attention sinks and sliding windows, composed with document masking, in every attention method.

The reference (tests/attention_reference.py) is written independently of attention.py: scores q·k/√D in
float64, the "same document, causal, i - j < window" mask, one extra logit per head (the sink) in the
softmax, dropped before the value product (what transformers' GPT-OSS eager attention computes). Every
method must match it in values and in the gradients of q, k, v and the sinks (float32, 1e-5); flex (no
CPU backward in torch 2.13) in values on CPU, values and gradients on CUDA.
"""

import pytest
import torch

from attention_reference import ids_from_lengths, reference, run
from moetrain.model.attention import AttentionPlan, attend, block_layout, plan_attention

TOL = dict(rtol=1e-5, atol=1e-5)
# Documents shorter than, equal to and longer than the windows below; one row a single document.
ROWS = [[1, 15, 16, 17, 3, 40, 4], [96], [33, 2, 61]]


def inputs(rows, heads=4, kv_heads=2, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch, seq = len(rows), sum(rows[0])
    q = torch.randn(batch, seq, heads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, seq, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    sinks = torch.randn(heads, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(batch, seq, heads, head_dim, generator=gen, dtype=torch.float64)
    return q, k, v, sinks, grad_out


def compare(got, want):
    names = ("out", "dq", "dk", "dv", "dsinks")
    assert len(got) == len(want)
    for name, a, b in zip(names, got, want, strict=False):
        torch.testing.assert_close(a.double(), b.double(), **TOL, msg=name)


CASES = {"sinks": (True, None), "window8": (False, 8), "window16+sinks": (True, 16), "window1": (False, 1),
         "window200+sinks": (True, 200)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("method", ["dense", "segments", "blocks", "auto"])
def test_methods_match_the_reference_with_documents(method, case):
    with_sinks, window = CASES[case]
    ids = ids_from_lengths(ROWS)
    q, k, v, sinks, grad_out = inputs(ROWS)
    sinks = sinks if with_sinks else None
    want = run(lambda q, k, v, s: reference(q, k, v, ids, s, window), q, k, v, sinks, grad_out, torch.float64)
    got = run(lambda q, k, v, s: attend(q, k, v, plan_attention(ids, method), s, window), q, k, v, sinks,
              grad_out, torch.float32)
    compare(got, want)


@pytest.mark.parametrize("case", CASES)
def test_rows_without_documents_match_the_reference(case):
    """The "causal" plan (no document ids, or one document per row) with sinks and windows."""
    with_sinks, window = CASES[case]
    rows = [[96], [96]]
    q, k, v, sinks, grad_out = inputs(rows, kv_heads=1)
    sinks = sinks if with_sinks else None
    want = run(lambda q, k, v, s: reference(q, k, v, None, s, window), q, k, v, sinks, grad_out, torch.float64)
    for plan in (None, plan_attention(torch.zeros(2, 96, dtype=torch.long), "auto")):
        assert plan is None or plan.method == "causal"
        got = run(lambda q, k, v, s, plan=plan: attend(q, k, v, plan, s, window), q, k, v, sinks, grad_out,
                  torch.float32)
        compare(got, want)


@pytest.mark.parametrize("block", [4, 8, 32])
def test_blocks_with_windows_spanning_several_key_blocks(block):
    ids = ids_from_lengths(ROWS)
    q, k, v, sinks, grad_out = inputs(ROWS, seed=2)
    for window in (3, 8, 21):
        want = run(lambda q, k, v, s, w=window: reference(q, k, v, ids, s, w), q, k, v, sinks, grad_out,
                   torch.float64)
        plan = AttentionPlan("blocks", blocks=block_layout(ids, block), document_ids=ids)
        got = run(lambda q, k, v, s, p=plan, w=window: attend(q, k, v, p, s, w), q, k, v, sinks, grad_out,
                  torch.float32)
        compare(got, want)


def test_the_window_and_the_sinks_change_the_result():
    """Guards the tests above: a window shorter than the documents and a sink are not no-ops."""
    ids = ids_from_lengths(ROWS)
    q, k, v, sinks, _ = inputs(ROWS)
    plain = reference(q, k, v, ids, None, None)
    assert (reference(q, k, v, ids, None, 8) - plain).abs().max() > 1e-2
    assert (reference(q, k, v, ids, sinks, None) - plain).abs().max() > 1e-2


@pytest.mark.parametrize("case", CASES)
def test_flex_forward_matches_the_reference_on_cpu(case):
    with_sinks, window = CASES[case]
    ids = ids_from_lengths(ROWS)
    q, k, v, sinks, _ = inputs(ROWS)
    sinks = sinks if with_sinks else None
    want = reference(q, k, v, ids, sinks, window)
    with torch.no_grad():
        got = attend(q.float(), k.float(), v.float(), plan_attention(ids, "flex"),
                     None if sinks is None else sinks.float(), window)
    torch.testing.assert_close(got.double(), want, **TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention's backward needs CUDA")
@pytest.mark.parametrize("case", CASES)
def test_flex_values_and_gradients_match_the_reference_on_cuda(case):
    with_sinks, window = CASES[case]
    ids = ids_from_lengths(ROWS).cuda()
    q, k, v, sinks, grad_out = (t.cuda() for t in inputs(ROWS))
    sinks = sinks if with_sinks else None
    want = run(lambda q, k, v, s: reference(q, k, v, ids, s, window), q, k, v, sinks, grad_out, torch.float64)
    for plan in (plan_attention(ids, "flex"), plan_attention(ids, "auto")):
        assert plan.method == "flex"
        got = run(lambda q, k, v, s, plan=plan: attend(q, k, v, plan, s, window), q, k, v, sinks, grad_out,
                  torch.float32)
        for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=False):
            # compiled flex accumulates in float32 tiles: 1e-4 relative is its documented level
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=name)


def test_bad_options_are_refused():
    q, k, v, sinks, _ = inputs([[8]])
    with pytest.raises(ValueError, match="sliding window 0"):
        attend(q, k, v, None, None, 0)
    with pytest.raises(ValueError, match="one per query head"):
        attend(q, k, v, None, sinks[:2], None)
