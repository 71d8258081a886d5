"""Where the router's gradient comes from: the top-1 renormalised gate that gives it none (refused at
config validation), and the Switch balance loss's gradient against its closed form.

Top-1 with renormalised gates: the gate is g / g = 1 for every token, so the language-model loss
sends the router exactly zero gradient (the quality grid's 8-expert top-1 runs trained their router
on the aux loss alone and came out clearly behind); `JobConfig.validate` refuses the combination.

Switch's balance loss L = E · Σ_e f_e · P_e with f_e (assignment shares, no gradient) and
P_e = mean_t p_te has, per token t and expert j, dL/dz_tj = (E / T) · p_tj · (f_j − Σ_e f_e · p_te)
through the softmax. The global-batch variant uses the whole step's f and T, and the microbatch
shares' gradients must add up to that closed form of the whole step.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.config.job import JobConfig
from moetrain.config.moe import MoEConfig
from moetrain.errors import ConfigError
from moetrain.model.moe import MoE
from moetrain.model.routing import balance_fractions, global_balance_share, switch_aux_loss

DIM = 10


def router_lm_grad(top_k: int, renormalize: bool, score_func: str = "softmax") -> torch.Tensor:
    """d(a random linear function of the MoE output)/d(router weight), float64, no balance loss."""
    cfg = MoEConfig(n_experts=6, top_k=top_k, expert_hidden=5, impl="loop", renormalize=renormalize,
                    score_func=score_func, load_balance="none")
    torch.manual_seed(0)
    moe = MoE(DIM, cfg).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
    moe.reset_buffers()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(24, DIM, dtype=torch.float64, generator=gen)
    out = moe(x)
    (out * torch.randn(out.shape, dtype=torch.float64, generator=gen)).sum().backward()
    return moe.router.weight.grad


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_top1_renormalised_gate_gives_the_router_no_lm_gradient(score_func):
    # The reason for the refusal, measured: zero up to float64 rounding of g / g (1e-16 against
    # gradients of order 1), while Switch's gate and top-2 do train the router.
    switch = router_lm_grad(1, False, score_func).abs().max()
    assert switch > 1e-2 and router_lm_grad(2, True, score_func).abs().max() > 1e-2
    assert router_lm_grad(1, True, score_func).abs().max() < 1e-12 * switch


def test_config_refuses_top1_with_renormalize_and_names_the_fix():
    cfg = JobConfig()
    cfg.model.moe.top_k, cfg.model.moe.renormalize = 1, True
    with pytest.raises(ConfigError) as refused:
        cfg.validate()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("model.moe.renormalize = True is invalid:")
    assert "model.moe.top_k = 1" in message and "model.moe.renormalize = False" in message
    # What the message says to set is accepted; so is top-2 renormalised (the default job), and
    # top-1 renormalised in a model with no MoE layer (the router does not exist).
    cfg.model.moe.renormalize = False
    cfg.validate()
    cfg.model.moe.top_k, cfg.model.moe.renormalize = 2, True
    cfg.validate()
    cfg.model.moe.top_k, cfg.model.n_dense_layers = 1, cfg.model.n_layers
    cfg.validate()


def closed_form_grad(probs_TE: torch.Tensor, fraction_E: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """dL/dz [T, E] of L = E · Σ_e f_e · Σ_t p_te / n_tokens with p = softmax(z), f constant."""
    n_experts = probs_TE.shape[1]
    mixed_T1 = (probs_TE * fraction_E).sum(dim=1, keepdim=True)
    return n_experts / n_tokens * probs_TE * (fraction_E - mixed_T1)


def test_switch_balance_loss_gradient_equals_the_closed_form_per_microbatch_and_global_batch():
    gen = torch.Generator().manual_seed(3)
    n_experts, top_k = 5, 2
    logits = [torch.randn(t, n_experts, dtype=torch.float64, generator=gen) * 2 for t in (7, 4, 9)]
    picks = [z.topk(top_k, dim=-1).indices for z in logits]
    counts = [torch.bincount(p.flatten(), minlength=n_experts) for p in picks]

    # Per microbatch: f and P of that microbatch alone (f_e over its T·k assignments).
    for z, c in zip(logits, counts, strict=True):
        z = z.clone().requires_grad_()
        probs = z.softmax(-1)
        loss = switch_aux_loss(probs, c, top_k)
        fraction = c.double() / (z.shape[0] * top_k)
        torch.testing.assert_close(loss, n_experts * (fraction * probs.mean(0)).sum(), rtol=1e-14, atol=0)
        (grad,) = torch.autograd.grad(loss, z)
        torch.testing.assert_close(grad, closed_form_grad(probs.detach(), fraction, z.shape[0]), rtol=1e-12,
                                   atol=1e-15)

    # Global batch: f over every microbatch's assignments, P over all 20 tokens; each microbatch's share
    # has the closed form's rows of its own tokens, and the shares add up to the whole-step loss.
    n_total = sum(z.shape[0] for z in logits)
    fraction = balance_fractions(sum(counts), n_total, top_k)
    leaves = [z.clone().requires_grad_() for z in logits]
    shares = [global_balance_share(z.softmax(-1), fraction, n_total) for z in leaves]
    grads = torch.autograd.grad(sum(shares), leaves)
    whole_probs = torch.cat([z.softmax(-1) for z in logits])
    torch.testing.assert_close(sum(shares).detach(), n_experts * (fraction * whole_probs.mean(0)).sum(),
                               rtol=1e-14, atol=0)
    torch.testing.assert_close(torch.cat(grads), closed_form_grad(whole_probs, fraction, n_total), rtol=1e-12,
                               atol=1e-15)
    # The two scopes really differ here (the test can tell a global loss computed per microbatch).
    per_mb_fraction = counts[0].double() / (logits[0].shape[0] * top_k)
    assert not torch.allclose(grads[0] * n_total / logits[0].shape[0],
                              closed_form_grad(whole_probs[:7], per_mb_fraction, 7))
