"""Token-weighted loss: per-token sums against a float64 closed form, ignored targets, empty microbatches."""

import math

import pytest
import torch

from moetrain.data.packing import IGNORE_INDEX
from moetrain.train.loss import microbatch_loss, token_loss_sum


def _closed_form(logits: torch.Tensor, targets: torch.Tensor) -> float:
    total = 0.0
    for row, target in zip(logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1), strict=True):
        if int(target) == IGNORE_INDEX:
            continue
        total += float(torch.logsumexp(row, 0) - row[int(target)])
    return total


def test_sum_and_count_match_closed_form_with_ignored_targets():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    targets[0, :2] = IGNORE_INDEX
    targets[2, 4] = IGNORE_INDEX
    loss_sum, n_valid = token_loss_sum(logits, targets)
    assert n_valid == 12
    assert math.isclose(float(loss_sum), _closed_form(logits, targets), rel_tol=1e-12)


def test_bf16_logits_are_summed_in_float32():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 64, 7, generator=gen).to(torch.bfloat16)
    targets = torch.randint(0, 7, (4, 64), generator=gen)
    loss_sum, n_valid = token_loss_sum(logits, targets)
    assert loss_sum.dtype == torch.float32 and n_valid == 256
    assert math.isclose(float(loss_sum), _closed_form(logits.double(), targets), rel_tol=1e-5)


def test_no_valid_target_gives_exact_zero_with_zero_gradient():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    targets = torch.full((2, 3), IGNORE_INDEX)
    loss_sum, n_valid = token_loss_sum(logits, targets)
    loss = microbatch_loss(loss_sum, n_valid, global_tokens=0, aux_loss=torch.tensor(0.7, requires_grad=True))
    loss.backward()
    assert n_valid == 0 and float(loss.detach()) == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_microbatch_losses_sum_to_the_global_mean():
    # Two microbatches with 1 and 5 valid tokens: their losses must add up to the mean
    # over all 6 tokens, not to the mean of the two microbatch means.
    gen = torch.Generator().manual_seed(2)
    logits_a, logits_b = torch.randn(1, 3, 4, generator=gen), torch.randn(1, 5, 4, generator=gen)
    targets_a = torch.tensor([[1, IGNORE_INDEX, IGNORE_INDEX]])
    targets_b = torch.randint(0, 4, (1, 5), generator=gen)
    sum_a, n_a = token_loss_sum(logits_a, targets_a)
    sum_b, n_b = token_loss_sum(logits_b, targets_b)
    total = microbatch_loss(sum_a, n_a, n_a + n_b) + microbatch_loss(sum_b, n_b, n_a + n_b)
    expected = (_closed_form(logits_a, targets_a) + _closed_form(logits_b, targets_b)) / 6
    assert math.isclose(float(total), expected, rel_tol=1e-6)


def test_aux_loss_is_weighted_by_the_microbatch_token_share():
    loss = microbatch_loss(torch.tensor(0.0), n_valid=3, global_tokens=12, aux_loss=torch.tensor(2.0))
    assert math.isclose(float(loss), 3 * 2.0 / 12)


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="disagree"):
        token_loss_sum(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
