"""Router z-loss and the global-batch balance loss: closed forms on hand-built numbers, float64
gradcheck, and the step objective's independence of how the batch is split into microbatches.

The global-batch loss is E · Σ_e f_e · P_e with f_e and P_e over the whole step; it must give the
same loss and gradients for 1×8, 2×4 and 8×1 (microbatches × sequences) and equal, to rounding,
the per-microbatch loss of one microbatch holding the whole batch. The distributed half (1 vs 4
ranks) is tests/distributed/test_families.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.packing import IGNORE_INDEX, Batch
from moetrain.model.routing import balance_fractions, global_balance_share, router_z_loss, switch_aux_loss
from moetrain.model.transformer import Transformer
from moetrain.train.global_balance import prepare_global_balance
from moetrain.train.loss import microbatch_loss, router_loss_terms, token_loss_sum


def test_z_loss_closed_form_on_hand_built_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0, 0.0], [50.0, 50.0, -50.0, -50.0]])
    # logsumexp: ln 4, ln(3 + 3) = ln 6, 50 + ln 2 (stable for large logits)
    expected = torch.tensor([math.log(4) ** 2, math.log(6) ** 2, (50 + math.log(2)) ** 2])
    torch.testing.assert_close(router_z_loss(logits), expected, rtol=1e-6, atol=0)
    assert router_z_loss(logits.bfloat16()).dtype == torch.float32


def test_global_balance_shares_sum_to_the_closed_form_of_the_whole_batch():
    # Two microbatches, E = 2 experts, top-1: microbatch a picks expert 0, b picks 0 and 1.
    probs_a = torch.tensor([[0.75, 0.25]], dtype=torch.float64)
    probs_b = torch.tensor([[0.5, 0.5], [0.25, 0.75]], dtype=torch.float64)
    counts = torch.tensor([2, 1])
    fraction = balance_fractions(counts, 3, top_k=1)
    torch.testing.assert_close(fraction, torch.tensor([2 / 3, 1 / 3], dtype=torch.float64))
    share_a = global_balance_share(probs_a, fraction, 3)
    share_b = global_balance_share(probs_b, fraction, 3)
    # f = (2/3, 1/3), P = (0.5, 0.5): L = 2 · (2/3 · 0.5 + 1/3 · 0.5) = 1
    assert math.isclose(float(share_a), 2 * (2 / 3 * 0.75 + 1 / 3 * 0.25) / 3, rel_tol=1e-15)
    assert math.isclose(float(share_a + share_b), 1.0, rel_tol=1e-15)
    # = the switch loss of one microbatch holding all three tokens
    whole = switch_aux_loss(torch.cat([probs_a, probs_b]), counts, top_k=1)
    assert math.isclose(float(whole), 1.0, rel_tol=1e-15)
    # while the mean of the two per-microbatch losses is not
    per_mb = (switch_aux_loss(probs_a, torch.tensor([1, 0]), 1) + switch_aux_loss(probs_b, torch.tensor([1, 1]), 1)) / 2
    assert not math.isclose(float(per_mb), 1.0, rel_tol=1e-3)


def test_router_losses_pass_float64_gradcheck():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    fraction = torch.rand(4, dtype=torch.float64, generator=gen)
    assert torch.autograd.gradcheck(lambda z: router_z_loss(z), (logits,))
    assert torch.autograd.gradcheck(lambda z: global_balance_share(z.softmax(-1), fraction, 11), (logits,))
    counts = torch.tensor([3, 1, 4, 2])
    assert torch.autograd.gradcheck(lambda z: switch_aux_loss(z.softmax(-1), counts, 2), (logits,))


def tiny_model(scope: str) -> Transformer:
    moe = MoEConfig(n_experts=4, top_k=2, expert_hidden=6, impl="loop", aux_loss_coef=0.3, z_loss_coef=0.02,
                    aux_loss_scope=scope)
    cfg = ModelConfig(vocab_size=19, dim=16, n_layers=3, n_heads=2, n_dense_layers=1, ffn_hidden=12,
                      qk_norm="per_head", max_seq_len=16, moe=moe)
    model = Transformer(cfg).double()
    model.init_weights(seed=3)
    with torch.no_grad():  # a router far from uniform, so the balance loss has something to push
        for layer in model.moe_layers():
            layer.router.weight.mul_(40)
    return model


def make_batch(n_sequences: int = 8, seq: int = 10) -> Batch:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 19, (n_sequences, seq), generator=gen)
    targets = torch.randint(0, 19, (n_sequences, seq), generator=gen)
    targets[1, :4] = IGNORE_INDEX
    targets[n_sequences - 3] = IGNORE_INDEX  # a sequence with no valid target at all
    document_ids = (torch.arange(seq) >= 6).long().expand(n_sequences, seq)  # two documents per sequence
    positions = (torch.arange(seq) - 6 * document_ids[0]).expand(n_sequences, seq)
    return Batch(tokens, positions, document_ids, targets)


def split(batch: Batch, n_microbatches: int) -> list[Batch]:
    size = batch.tokens.shape[0] // n_microbatches
    return [Batch(*(t[i * size:(i + 1) * size] for t in (batch.tokens, batch.positions, batch.document_ids,
                                                         batch.targets))) for i in range(n_microbatches)]


def step(model: Transformer, microbatches: list[Batch]) -> tuple[float, float, float, dict[str, torch.Tensor]]:
    """What Trainer.train_step computes (one process): (LM loss, balance term, z term, gradients)."""
    model.zero_grad(set_to_none=True)
    global_tokens = sum(b.n_valid_targets for b in microbatches)
    prepare_global_balance(model, microbatches)
    share = model.cfg.moe.aux_loss_scope == "global_batch"
    lm = balance = z_total = 0.0
    for b in microbatches:
        loss_sum, n_valid = token_loss_sum(model(b.tokens, b.positions, b.document_ids), b.targets)
        aux, z = model.aux_loss(), model.z_loss_sum(b.targets != IGNORE_INDEX)
        microbatch_loss(loss_sum, n_valid, global_tokens, aux, z, share).backward()
        balance_term, z_term = router_loss_terms(n_valid, global_tokens, aux.detach(), z.detach(), share)
        lm += float(loss_sum.detach()) / global_tokens
        balance += float(balance_term)
        z_total += float(z_term)
    return lm, balance, z_total, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_global_batch_scope_gives_the_same_loss_and_gradients_for_every_split():
    model = tiny_model("global_batch")
    batch = make_batch()
    reference = step(tiny_model("microbatch"), [batch])  # one microbatch holding the whole batch
    results = {n: step(model, split(batch, n)) for n in (1, 2, 8)}
    for n, (lm, balance, z, grads) in results.items():
        assert math.isclose(lm, reference[0], rel_tol=1e-12), n
        assert math.isclose(balance, reference[1], rel_tol=1e-12), n
        assert math.isclose(z, reference[2], rel_tol=1e-12), n
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference[3][name], rtol=1e-10, atol=1e-13, msg=f"{n} {name}")
    assert reference[1] > 0.3 * 2 * 1.01  # unbalanced: above coef · layers · 1 (the balanced value)
    # the per-microbatch scope does depend on the split: the test can tell the two apart
    per_microbatch = step(tiny_model("microbatch"), split(batch, 8))
    assert not math.isclose(per_microbatch[1], reference[1], rel_tol=1e-3)


def test_global_scope_without_the_step_counts_refuses_instead_of_guessing():
    model = tiny_model("global_batch")
    batch = make_batch(2)
    model(batch.tokens)
    with pytest.raises(RuntimeError, match="set_global_balance"):
        model.aux_loss()
    assert model.needs_global_balance() and not tiny_model("microbatch").needs_global_balance()


def test_one_microbatch_on_one_rank_skips_the_counting_pass_and_changes_nothing(monkeypatch):
    """One microbatch, one rank: the MoE layers take their own forward's counts (no pre-pass). The
    losses and gradients must equal, bit for bit, those of the step with the counting pass (forced
    here by reporting two ranks, whose all-reduce is then the identity), and the pass must not run."""
    import moetrain.train.global_balance as global_balance

    batch = make_batch()
    forwards = []
    model = tiny_model("global_batch")
    model.register_forward_pre_hook(lambda module, args: forwards.append(module.training))
    skipped = step(model, [batch])
    assert forwards == [True], "the one-microbatch step ran a counting pass"
    monkeypatch.setattr(global_balance, "rank_and_world", lambda: (0, 2))
    forwards.clear()
    with_pass = tiny_model("global_batch")
    with_pass.register_forward_pre_hook(lambda module, args: forwards.append(module.training))
    counted = step(with_pass, [batch])
    assert forwards == [False, True]  # the pass (eval mode), then the training forward
    assert skipped[:3] == counted[:3]
    for name, grad in skipped[3].items():
        assert torch.equal(grad, counted[3][name]), name
    # and both are the loss of the per-microbatch scope on the whole batch (the closed form above)
    assert math.isclose(skipped[1], step(tiny_model("microbatch"), [batch])[1], rel_tol=1e-12)
