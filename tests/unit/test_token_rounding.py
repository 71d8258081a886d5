"""Token rounding: every expert's count becomes a multiple of the tile by the cheaper of dropping its
lowest-score assignments or filling with its best unrouted tokens; tile 1 changes nothing."""

from __future__ import annotations

import pytest
import torch

from moetrain.errors import ModelError
from moetrain.model.experts import routed_experts
from moetrain.model.routing import round_routing, routing_from_topk


def make_routing(tokens=40, n_experts=6, top_k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, n_experts, generator=gen, dtype=torch.float64).requires_grad_()
    probs = logits.softmax(-1)
    top_scores, top_idx = probs.topk(top_k, dim=-1)
    return logits, probs, routing_from_topk(top_idx, top_scores, n_experts)


def assignment_sets(routing):
    """{expert: {token: score}} built from the grouped layout."""
    out, start = {}, 0
    for e, count in enumerate(routing.counts.tolist()):
        tokens = routing.token_index[start : start + count].tolist()
        scores = routing.scores[start : start + count].tolist()
        out[e] = dict(zip(tokens, scores, strict=True))
        start += count
    return out


@pytest.mark.parametrize("tile", [2, 4, 8, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_counts_become_multiples_by_the_cheaper_choice(tile, seed):
    _, probs, routing = make_routing(seed=seed)
    tokens = probs.shape[0]
    rounded, changed = round_routing(probs, routing, tile)
    assert all(c % tile == 0 for c in rounded.counts.tolist())
    assert int(rounded.counts.sum()) == rounded.n_assignments == rounded.scores.numel()
    before, after = assignment_sets(routing), assignment_sets(rounded)
    expected_changes = 0
    for e, count in enumerate(routing.counts.tolist()):
        remainder = count % tile
        fill = (tile - remainder) % tile
        dropped, added = set(before[e]) - set(after[e]), set(after[e]) - set(before[e])
        assert not (dropped and added)
        if remainder and (remainder <= fill or count + fill > tokens):  # drop: the lowest-score ones
            assert len(dropped) == remainder
            kept_min = min((before[e][t] for t in after[e]), default=float("inf"))
            assert all(before[e][t] <= kept_min for t in dropped)
        elif remainder:  # fill: the best tokens not already routed to e, with their router probability
            assert len(added) == fill
            outside = [t for t in range(tokens) if t not in before[e]]
            best = sorted(outside, key=lambda t: -float(probs.detach()[t, e]))[:fill]
            assert added == set(best)
            assert all(after[e][t] == pytest.approx(float(probs.detach()[t, e])) for t in added)
        expected_changes += len(dropped) + len(added)
        # layout stays grouped by expert, tokens ascending within an expert, no duplicates
        assert list(after[e]) == sorted(after[e])
    assert changed == expected_changes


def test_tile_one_leaves_routing_unchanged():
    _, probs, routing = make_routing()
    rounded, changed = round_routing(probs, routing, 1)
    assert changed == 0
    assert torch.equal(rounded.token_index, routing.token_index)
    assert torch.equal(rounded.counts, routing.counts)
    assert torch.equal(rounded.scores, routing.scores)


def test_fill_and_drop_on_a_hand_built_case():
    # expert 0 has 3 tokens (tile 4: fill 1 is cheaper than dropping 3); expert 1 has 5 (drop 1).
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.4, 0.6], [0.35, 0.65], [0.2, 0.8],
                          [0.45, 0.55], [0.1, 0.9]], dtype=torch.float64)
    top_idx = probs.argmax(-1, keepdim=True)
    routing = routing_from_topk(top_idx, probs.gather(1, top_idx), 2)
    assert routing.counts.tolist() == [3, 5]
    rounded, changed = round_routing(probs, routing, 4)
    assert changed == 2 and rounded.counts.tolist() == [4, 4]
    # expert 0 gains token 6 (its best unrouted prob 0.45); expert 1 loses token 6 (its lowest score 0.55)
    assert rounded.token_index.tolist() == [0, 1, 2, 6, 3, 4, 5, 7]
    assert rounded.scores.tolist() == pytest.approx([0.9, 0.8, 0.7, 0.45, 0.6, 0.65, 0.8, 0.9])


def test_already_multiple_counts_unchanged():
    probs = torch.rand(8, 2)
    routing = routing_from_topk(torch.tensor([[0], [0], [0], [0], [1], [1], [1], [1]]), torch.ones(8, 1), 2)
    rounded, changed = round_routing(probs, routing, 4)
    assert changed == 0 and rounded.counts.tolist() == [4, 4]


def test_rounded_scores_stay_differentiable_to_the_router():
    logits, probs, routing = make_routing(tokens=30, n_experts=5, top_k=2, seed=3)
    rounded, changed = round_routing(probs, routing, 4)
    assert changed > 0
    x = torch.randn(30, 8, dtype=torch.float64)
    w1 = torch.randn(5, 8, 8, dtype=torch.float64)
    w2 = torch.randn(5, 4, 8, dtype=torch.float64)
    out = routed_experts(x, rounded, w1, w2, "swiglu", "memory_efficient")
    (grad_logits,) = torch.autograd.grad(out.square().sum(), logits)
    assert torch.isfinite(grad_logits).all() and grad_logits.abs().sum() > 0
    reference = routed_experts(x, rounded, w1, w2, "swiglu", "loop")
    assert torch.allclose(out, reference, rtol=1e-12, atol=1e-12)


def test_bad_arguments():
    _, probs, routing = make_routing()
    with pytest.raises(ModelError, match="token_rounding_tile = 0"):
        round_routing(probs, routing, 0)
    with pytest.raises(ValueError, match="router_probs has 3 experts"):
        round_routing(probs[:, :3], routing, 4)
