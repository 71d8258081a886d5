"""DeepSeek-V3 routing rules against closed forms on hand-built scores, and against transformers' own router.

Scores are set exactly through sigmoid logits log(p / (1 - p)) in float64, so which groups, which
experts and which weights a token gets can be written down by hand: groups are scored by the sum of
their top-2 choice scores (not their best one), the correction bias changes the choice but not the
weights, weights are renormalised and then multiplied by routed_scaling_factor.
"""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.config.job import JobConfig
from moetrain.config.moe import MoEConfig
from moetrain.errors import ConfigError, ModelError
from moetrain.model.moe import MoE
from moetrain.model.routing import group_mask, select_experts

# Two tokens, 8 experts in 4 groups of 2 (groups: {0,1} {2,3} {4,5} {6,7}).
SCORES = torch.tensor([
    # group sums of top-2: 1.0, 0.95, 1.1, 0.35 -> groups 2 and 0; the plain top-3 would take expert 2 (0.5).
    [0.9, 0.1, 0.5, 0.45, 0.8, 0.3, 0.2, 0.15],
    # the single best expert (0: 0.95) sits in group 0 (sum 1.0), beaten by groups 1 (1.2) and 2 (1.05).
    [0.95, 0.05, 0.6, 0.6, 0.55, 0.5, 0.1, 0.1],
], dtype=torch.float64)


def logits_of(scores: torch.Tensor) -> torch.Tensor:
    return torch.log(scores / (1 - scores))


def chosen(idx: torch.Tensor) -> list[list[int]]:
    return [sorted(row) for row in idx.tolist()]


def test_groups_are_scored_by_their_top_two_sum_then_top_k_inside_them():
    mask = group_mask(SCORES, n_group=4, topk_group=2)
    assert mask.tolist() == [[True, True, False, False, True, True, False, False],
                             [False, False, True, True, True, True, False, False]]
    _, idx, gates = select_experts(logits_of(SCORES), "sigmoid", 3, renormalize=True, n_group=4, topk_group=2)
    assert chosen(idx) == [[0, 4, 5], [2, 3, 4]]
    for row, experts in enumerate(chosen(idx)):
        picked = SCORES[row, experts]
        order = idx[row].argsort()
        want = picked / picked.sum()
        assert torch.allclose(gates[row][order], want, atol=1e-12)
    # Without groups the same scores give the plain top-3.
    _, plain, _ = select_experts(logits_of(SCORES), "sigmoid", 3, renormalize=True)
    assert chosen(plain) == [[0, 2, 4], [0, 2, 3]]


def test_correction_bias_chooses_but_does_not_weight_and_scaling_multiplies_renormalised_gates():
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 0.5, 0.5], dtype=torch.float64)
    # Token 0 with the bias: group 3 scores 0.7 + 0.65 = 1.35 -> groups 3 and 2 -> choice scores 0.8, 0.3, 0.7,
    # 0.65 -> experts 4, 6, 7; weights from the unbiased scores 0.8, 0.2, 0.15.
    _, idx, gates = select_experts(logits_of(SCORES[:1]), "sigmoid", 3, renormalize=True, choice_bias=bias,
                                   n_group=4, topk_group=2, scaling=2.5)
    assert chosen(idx) == [[4, 6, 7]]
    by_expert = dict(zip(idx[0].tolist(), gates[0].tolist(), strict=True))
    total = 0.8 + 0.2 + 0.15
    for expert, score in ((4, 0.8), (6, 0.2), (7, 0.15)):
        assert math.isclose(by_expert[expert], 2.5 * score / total, rel_tol=1e-12)
    # Not renormalised: the scaled raw scores.
    _, idx, gates = select_experts(logits_of(SCORES[:1]), "sigmoid", 3, renormalize=False, choice_bias=bias,
                                   n_group=4, topk_group=2, scaling=2.5)
    assert sorted(gates[0].tolist()) == pytest.approx(sorted(2.5 * s for s in (0.8, 0.2, 0.15)), rel=1e-12)


def test_topk_group_equal_to_n_group_is_plain_top_k():
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    bias = 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grouped = select_experts(logits, "sigmoid", 4, True, bias, n_group=4, topk_group=4)
    plain = select_experts(logits, "sigmoid", 4, True, bias)
    assert chosen(grouped[1]) == chosen(plain[1])


@pytest.mark.parametrize("n_group, topk_group, top_k", [(4, 2, 3), (8, 3, 2), (1, 1, 4)])
def test_router_equals_transformers_deepseek_v3_router(n_group, topk_group, top_k):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    n_experts, dim = 16, 24
    hf_cfg = DeepseekV3Config(hidden_size=dim, n_routed_experts=n_experts, num_experts_per_tok=top_k, n_group=n_group,
                              topk_group=topk_group, routed_scaling_factor=1.7, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(hf_cfg)
    gen = torch.Generator().manual_seed(n_group)
    with torch.no_grad():
        router.weight.copy_(torch.randn(n_experts, dim, generator=gen))
        router.e_score_correction_bias.copy_(0.2 * torch.randn(n_experts, generator=gen))
    moe = MoE(dim, MoEConfig(n_experts=n_experts, top_k=top_k, score_func="sigmoid", load_balance="aux_free",
                             n_group=n_group, topk_group=topk_group, routed_scaling_factor=1.7))
    with torch.no_grad():
        moe.router.weight.copy_(router.weight)
        moe.expert_bias.copy_(router.e_score_correction_bias)
    x = torch.randn(50, dim, generator=gen)
    _, want_w, want_idx = router(x)
    _, idx, gates = moe.route(moe.router(x))
    assert chosen(idx) == chosen(want_idx)
    got = torch.zeros(50, n_experts).scatter(1, idx, gates.float())
    want = torch.zeros(50, n_experts).scatter(1, want_idx, want_w)
    assert torch.allclose(got, want, atol=1e-6)


def test_bad_group_settings_are_refused():
    with pytest.raises(ModelError, match="group-limited routing"):
        group_mask(SCORES, n_group=3, topk_group=1)
    with pytest.raises(ModelError, match="group-limited routing"):
        group_mask(SCORES, n_group=8, topk_group=1)  # groups of one expert have no top-2
    for moe, message in (
        (MoEConfig(n_experts=8, top_k=2, n_group=3), "model.moe.n_group = 3 is invalid: must be a positive divisor"),
        (MoEConfig(n_experts=8, top_k=1, n_group=8), "each needs >= 2 experts"),
        (MoEConfig(n_experts=8, top_k=2, n_group=4, topk_group=5), "model.moe.topk_group = 5 is invalid"),
        (MoEConfig(n_experts=8, top_k=5, n_group=4, topk_group=2), "model.moe.top_k = 5 is invalid"),
        (MoEConfig(n_experts=8, top_k=2, routed_scaling_factor=0.0), "routed_scaling_factor = 0.0 is invalid"),
    ):
        cfg = JobConfig()
        cfg.model.moe = moe
        with pytest.raises(ConfigError, match=message):
            cfg.validate()
