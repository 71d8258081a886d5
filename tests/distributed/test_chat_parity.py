"""Conversations (loss on the assistant's tokens only) on a 2x2 HSDP mesh: gradients of one float64 process.

The data is a stream of conversations with a loss mask (as `data prepare --format chat`
writes them): user text at mask 0, assistant replies at mask 1, conversations bounded by
their offsets, not by EOS. Every rank takes its 3 token-budget microbatches of each global
batch from the loader (one row of whole conversations of at most 16 tokens, longer ones cut
into pieces), so the count of assistant targets differs across ranks and microbatches, and
step 0 holds a microbatch with none at all (its loss is an exact 0, no NaN). The
reference is one float64 process that reads the same
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
from moetrain.data.packing import PackedSequences, TokenStream
from moetrain.testing import run_on_ranks

BOS, EOS, PAD = MODEL_CFG.vocab_size - 3, MODEL_CFG.vocab_size - 2, MODEL_CFG.vocab_size - 1
BUDGET = 16
MICRO = 3
STEPS = 2
WORLD = 4


def batching() -> TokenBudgetBatching:
    """Conversations of 1 to 3 exchanges (user turns up to 14 tokens at mask 0, replies of 1 to 4 tokens
    ending in EOS at mask 1), in bins of at most BUDGET tokens."""
    rng = np.random.default_rng(11)
    tokens, mask, starts = [], [], []
    for _ in range(50):
        starts.append(len(tokens))
        for _ in range(int(rng.integers(1, 4))):
            user = [BOS, *rng.integers(0, BOS, int(rng.integers(1, 15))).tolist()]
            reply = [*rng.integers(0, BOS, int(rng.integers(0, 4))).tolist(), EOS]
            tokens += user + reply
            mask += [0] * len(user) + [1] * len(reply)
    sequences = PackedSequences(torch.tensor(tokens, dtype=torch.int32), BUDGET, eos_id=EOS, pad_id=PAD,
                                document_starts=np.array(starts), loss_mask=TokenStream([np.array(mask, np.uint8)], 0))
    return TokenBudgetBatching(sequences, BUDGET, seed=11)  # a layout whose step 0 has two microbatches with none


def assistant_targets(microbatch) -> int:
    return microbatch.n_valid_targets


def test_conversation_microbatches_on_hsdp_2x2_match_one_float64_process():
    state = initial_state(seed=1)
    ref_grads, ref_params, ref_lengths, gap = token_budget_reference_run(
        state, batching, assistant_targets, MICRO, STEPS, WORLD)
    results = run_on_ranks(token_budget_hsdp_worker, WORLD, state, batching, assistant_targets, MICRO, STEPS,
                           timeout=300)
    assert {r[0] for r in results} == {"delayed_all_reduce"}
    # The ranks' microbatches, in rank order, are the reference's global batch; assistant-target counts vary
    # across ranks, and one microbatch of step 0 has none.
    for step in range(STEPS):
        assert [n for r in results for n in r[1][step]] == ref_lengths[step]
    per_rank = [sum(r[1][0]) for r in results]
    assert len(set(per_rank)) > 1 and 0 in ref_lengths[0], (per_rank, ref_lengths[0])
    assert gap > 1e-4  # no float32 routing flip can explain (or hide) a difference
    grads, params = results[0][2], results[0][3]
    assert all(np.isfinite(g).all() for g in grads.values())
    grad_error, name = relative_error(grads, ref_grads)
    print(f"conversations on HSDP 2x2: gradient relative error {grad_error:.2e} ({name})")
    assert grad_error < 1e-5, (grad_error, name)
    update = {n: ref_params[n] - state[n].double() for n in ref_params}
    param_error, name = relative_error(params, ref_params, scale=update)
    assert param_error < 5e-5, (param_error, name)
    assert all(float(g.abs().max()) > 0 for g in ref_grads.values() if g.numel() > 0)
