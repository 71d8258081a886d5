"""MoE layer end to end against an independent per-token float64 reference; aux loss; aux-free bias."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from moetrain.config.moe import MoEConfig
from moetrain.model.moe import MoE

DIM = 12


def make_moe(seed: int = 0, **overrides) -> MoE:
    cfg = MoEConfig(**{"n_experts": 5, "top_k": 2, "expert_hidden": 7, "impl": "loop", **overrides})
    torch.manual_seed(seed)
    moe = MoE(DIM, cfg).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.4)
    moe.reset_buffers()
    return moe


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per token: router -> scores -> top-k (+bias for the choice) -> Σ gate · expert(x) (+ shared)."""
    cfg, n = moe.cfg, moe.cfg.expert_hidden
    w_router, w1, w2 = moe.router.weight, moe.experts.w1, moe.experts.w2
    outs = []
    for t in range(x.shape[0]):
        xt = x[t]
        logits = w_router @ xt
        scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        key = scores + moe.expert_bias.double() if cfg.load_balance == "aux_free" else scores
        chosen = sorted(range(cfg.n_experts), key=lambda e: -float(key[e].detach()))[:cfg.top_k]
        gates = torch.stack([scores[e] for e in chosen])
        if cfg.renormalize:
            gates = gates / gates.sum()
        out = torch.zeros_like(xt)
        for gate, e in zip(gates, chosen):
            h = xt @ w1[e]
            act = F.silu(h[:n]) * h[n:] if cfg.activation == "swiglu" else F.gelu(h)
            out = out + gate * (act @ w2[e])
        if moe.shared_expert is not None:
            s = moe.shared_expert
            out = out + s.w2.weight @ (F.silu(s.w1.weight @ xt) * (s.w3.weight @ xt))
        outs.append(out)
    return torch.stack(outs)


CASES = [dict(score_func=s, renormalize=r, n_shared_experts=sh, activation=a)
         for s, r, sh, a in itertools.product(["softmax", "sigmoid"], [True, False], [0, 1], ["swiglu", "gelu"])]


@pytest.mark.parametrize("impl", ["loop", "grouped", "memory_efficient"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_moe_matches_per_token_reference_forward_and_gradients(case, impl):
    moe = make_moe(seed=len(str(case)), impl=impl, **case)
    x = torch.randn(3, 6, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x_ref = x.reshape(-1, DIM).clone().requires_grad_()
    x_mod = x.clone().requires_grad_()
    out = moe(x_mod)
    expected = reference(moe, x_ref)
    torch.testing.assert_close(out.reshape(-1, DIM), expected, rtol=1e-10, atol=1e-10)
    weight = torch.randn_like(expected)
    params = [p for p in moe.parameters()]
    got = torch.autograd.grad((out.reshape(-1, DIM) * weight).sum(), [x_mod, *params])
    want = torch.autograd.grad((expected * weight).sum(), [x_ref, *params], allow_unused=True)
    torch.testing.assert_close(got[0].reshape(-1, DIM), want[0], rtol=1e-9, atol=1e-10)
    for (name, _), g, w in zip(moe.named_parameters(), got[1:], want[1:]):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=name)


def test_tokens_per_expert_and_switch_aux_loss_match_hand_computation():
    moe = make_moe(seed=4)
    x = torch.randn(40, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    moe(x)
    probs = (x @ moe.router.weight.T).softmax(-1)
    top = probs.topk(2, dim=-1).indices
    counts = torch.bincount(top.flatten(), minlength=5)
    assert moe.tokens_per_expert.tolist() == counts.tolist()
    expected = 5 * sum((counts[e] / 80.0) * probs[:, e].mean() for e in range(5))
    torch.testing.assert_close(moe.aux_loss, expected)


def test_aux_loss_is_one_for_a_uniform_router():
    moe = make_moe()
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(torch.randn(16, DIM, dtype=torch.float64))
    torch.testing.assert_close(moe.aux_loss, torch.tensor(1.0, dtype=torch.float64))


def test_aux_free_bias_steers_the_choice_but_not_the_gates():
    moe = make_moe(load_balance="aux_free", score_func="sigmoid", renormalize=False)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([10.0, 0, 0, 0, 10.0]))
    x = torch.randn(30, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out = moe(x)
    assert moe.tokens_per_expert.tolist() == [30, 0, 0, 0, 30]
    torch.testing.assert_close(out, reference(moe, x), rtol=1e-10, atol=1e-10)


def test_aux_free_bias_update_moves_towards_balance_and_uses_the_injected_all_reduce():
    moe = make_moe(load_balance="aux_free", bias_update_rate=0.01)
    moe.train()
    x = torch.randn(50, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    moe(x)
    moe(x)  # loads accumulate over microbatches
    loads = 2 * moe.tokens_per_expert.double()
    calls = []

    def fake_all_reduce(t):
        calls.append(t.clone())
        t.mul_(3)  # as if three identical ranks

    moe.update_expert_bias(fake_all_reduce)
    assert len(calls) == 1 and calls[0].tolist() == loads.tolist()
    expected = 0.01 * torch.sign(loads.mean() - loads)
    torch.testing.assert_close(moe.expert_bias.double(), expected)
    assert moe.load_since_update.sum() == 0
    moe.update_expert_bias()  # nothing accumulated since: no change
    torch.testing.assert_close(moe.expert_bias.double(), expected)


def test_bias_update_is_a_no_op_without_aux_free_balancing():
    moe = make_moe(load_balance="aux_loss")
    moe.train()
    moe(torch.randn(10, DIM, dtype=torch.float64))
    moe.update_expert_bias()
    assert moe.expert_bias.abs().sum() == 0 and moe.load_since_update.sum() == 0


def test_token_rounding_makes_expert_counts_multiples_of_the_tile():
    moe = make_moe(token_rounding_tile=4)
    moe(torch.randn(30, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(7)))
    assert all(c % 4 == 0 for c in moe.tokens_per_expert.tolist())
