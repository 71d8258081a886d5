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
from test_parity_support import (
    LR,
    MODEL_CFG,
    MOMENTUM,
    initial_state,
    install_router_probe,
    load_full_state,
    parallel_cfg,
    relative_error,
)

from moetrain.data.batching import TokenBudgetBatching
from moetrain.data.loader import DataLoader
from moetrain.data.packing import PackedSequences, TokenStream
from moetrain.model.transformer import Transformer
from moetrain.testing import run_on_ranks
from moetrain.train.build import build_model
from moetrain.train.loss import microbatch_loss, token_loss_sum

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


def _step_loss(model, microbatches, global_tokens: int):
    for batch in microbatches:
        logits = model(batch.tokens, positions=batch.positions, document_ids=batch.document_ids)
        loss_sum, n_valid = token_loss_sum(logits, batch.targets)
        yield microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss())


def reference_run(state):
    """One float64 process over the world-1 loader: (grads of step 0, params after STEPS, assistant targets per
    microbatch, min top-k gap)."""
    model = Transformer(MODEL_CFG)
    model.load_state_dict(state)
    model.double()
    install_router_probe(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loader = DataLoader(batching(), seed=5, dp_rank=0, dp_world=1, microbatches_per_rank=MICRO * WORLD)
    grads0, lengths, gap = {}, [], float("inf")
    for step in range(STEPS):
        microbatches = loader.next_microbatches()
        lengths.append([mb.n_valid_targets for mb in microbatches])
        global_tokens = sum(mb.n_valid_targets for mb in microbatches)
        for loss in _step_loss(model, microbatches, global_tokens):
            loss.backward()
            for moe in model.moe_layers():
                top = moe._parity_last_probs.topk(moe.cfg.top_k + 1, dim=-1).values
                gap = min(gap, float((top[:, -2] - top[:, -1]).min()))
        if step == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return grads0, {n: p.detach().clone() for n, p in model.named_parameters()}, lengths, gap


def hsdp_worker(state):
    """On each of 4 ranks: HSDP 2x2, delayed all-reduce, this rank's token-budget microbatches."""
    import torch.distributed as dist

    from moetrain.parallel.grad_sync import accumulation, count_global_tokens, resolve_sync_policy
    from moetrain.parallel.mesh import build_mesh, init_distributed

    pcfg = parallel_cfg((2, 2), "delayed_all_reduce", "fp32")
    rank, world, device = init_distributed(pcfg)
    mesh = build_mesh(pcfg, world, device.type)
    model = build_model(MODEL_CFG, pcfg, mesh, device, weights="none")
    load_full_state(model, state)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    policy = resolve_sync_policy(pcfg, mesh, MICRO)
    loader = DataLoader(batching(), seed=5, dp_rank=rank, dp_world=world, microbatches_per_rank=MICRO)
    grads0, lengths = {}, []
    for step in range(STEPS):
        microbatches = loader.next_microbatches()
        lengths.append([mb.n_valid_targets for mb in microbatches])
        global_tokens = count_global_tokens(sum(mb.n_valid_targets for mb in microbatches))
        for batch, _is_last in accumulation(model, microbatches, policy):
            (loss,) = _step_loss(model, [batch], global_tokens)
            loss.backward()
        if step == 0:
            grads0 = {n: p.grad.full_tensor().double().numpy() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    params = {n: p.full_tensor().detach().double().numpy() for n, p in model.named_parameters()}
    dist.barrier()
    return policy.name, lengths, grads0, params


def test_conversation_microbatches_on_hsdp_2x2_match_one_float64_process():
    state = initial_state(seed=1)
    ref_grads, ref_params, ref_lengths, gap = reference_run(state)
    results = run_on_ranks(hsdp_worker, WORLD, state, timeout=300)
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
