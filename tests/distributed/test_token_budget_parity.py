"""Token-budget microbatches on a 2x2 HSDP mesh with the delayed all-reduce: gradients of one float64 process.

Every rank takes its 3 microbatches of each global batch from the loader (one row of whole
documents of at most 16 tokens each, so lengths differ across ranks and microbatches; some
documents are cut into pieces). The reference is one float64 process that reads the same
global batches from a world-1 loader with 12 microbatches per step, and backpropagates
Σ(token loss sums + n_valid · aux) / N_global microbatch by microbatch, sharing no code with
moetrain.parallel. Bounds as in test_parity.py (fp32 vs float64): gradients 1e-5
relative, parameters after 2 SGD steps 5e-5 of the update.
"""

from __future__ import annotations

import numpy as np
import torch
from parity_support import (
    MODEL_CFG,
    initial_state,
    relative_error,
    token_budget_hsdp_worker,
    token_budget_reference_run,
)

from moetrain.data.batching import TokenBudgetBatching
from moetrain.data.packing import PackedSequences
from moetrain.testing import run_on_ranks

BOS, EOS, PAD = MODEL_CFG.vocab_size - 3, MODEL_CFG.vocab_size - 2, MODEL_CFG.vocab_size - 1
BUDGET = 16
MICRO = 3
STEPS = 2
WORLD = 4


def batching() -> TokenBudgetBatching:
    """Documents of 2 to 30 tokens (some longer than the budget) in bins of at most BUDGET tokens."""
    rng = np.random.default_rng(11)
    stream = [t for _ in range(60) for t in [BOS, *rng.integers(0, BOS, int(rng.integers(0, 29))).tolist(), EOS]]
    sequences = PackedSequences(torch.tensor(stream, dtype=torch.int32), BUDGET, eos_id=EOS, pad_id=PAD)
    return TokenBudgetBatching(sequences, BUDGET, seed=2)


def row_width(microbatch) -> int:
    return microbatch.tokens.shape[1]


def test_token_budget_microbatches_on_hsdp_2x2_match_one_float64_process():
    state = initial_state(seed=1)
    ref_grads, ref_params, ref_lengths, gap = token_budget_reference_run(
        state, batching, row_width, MICRO, STEPS, WORLD)
    results = run_on_ranks(token_budget_hsdp_worker, WORLD, state, batching, row_width, MICRO, STEPS,
                           timeout=300)
    assert {r[0] for r in results} == {"delayed_all_reduce"}
    # The ranks' microbatches, in rank order, are the reference's global batch; lengths vary.
    for step in range(STEPS):
        assert [n for r in results for n in r[1][step]] == ref_lengths[step]
    assert len({n for r in results for n in r[1][0]}) > 2 and max(ref_lengths[0]) <= BUDGET
    assert gap > 1e-4  # no float32 routing flip can explain (or hide) a difference
    grads, params = results[0][2], results[0][3]
    grad_error, name = relative_error(grads, ref_grads)
    assert grad_error < 1e-5, (grad_error, name)
    update = {n: ref_params[n] - state[n].double() for n in ref_params}
    param_error, name = relative_error(params, ref_params, scale=update)
    assert param_error < 5e-5, (param_error, name)
    assert all(float(g.abs().max()) > 0 for g in ref_grads.values() if g.numel() > 0)
