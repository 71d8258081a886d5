"""Muon under FSDP 4, HSDP 2x2 and expert parallelism on 4 gloo ranks against one process, with Newton–Schulz counted.

One 4-rank run serves every case: the parity grid's tiny 2-dense + 2-MoE transformer, its uneven
microbatches (2 per rank and step), 3 optimizer steps of `train.optimizer = "muon"` (Newton–Schulz in
float32, AdamW on the rest) built by `build_optimizer`. The reference is the same model and optimizer in this process,
unsharded, on the whole global batch: after 3 steps every parameter must match within 1e-6 of its
largest entry (float32), and in every step the ranks together must run Newton–Schulz exactly once
per matrix (counted by wrapping `moetrain.train.muon.orthogonalize` on every rank), no more (each
rank orthogonalizing everything) and no fewer.
"""

from __future__ import annotations

import pytest
import torch
from parity_support import MODEL_CFG, initial_state, load_full_state, make_batches, relative_error

from moetrain.config.parallel import ParallelConfig
from moetrain.config.train import TrainConfig
from moetrain.data.packing import IGNORE_INDEX
from moetrain.model.transformer import Transformer
from moetrain.testing import run_on_ranks
from moetrain.train import muon as muon_module
from moetrain.train.build import build_model
from moetrain.train.loss import microbatch_loss, token_loss_sum
from moetrain.train.optim import build_optimizer

BOUND = 1e-6
N_MICRO = 2  # uneven microbatches per rank and step (the parity grid's data, fewer of them: a faster test)
# (name, (dp_replicate, dp_shard), ep). EP 2 under HSDP: experts whole on each rank (left in place across the
# EP and expert-FSDP dimensions) and split over the replicate dimension; EP 2 x FSDP 2 without replication
# leaves them entirely in place, as one process does (checked by hand, not repeated here for time).
CASES = [("fsdp4", (1, 4), 1), ("hsdp2x2", (2, 2), 1), ("hsdp2x2_ep2", (2, 2), 2)]
# A large AdamW epsilon keeps the AdamW parameters' update a smooth function of the gradient: with 1e-8, an
# entry whose gradient is summation noise takes ±lr either way on its sign.
TRAIN = TrainConfig(optimizer="muon", lr=0.02, muon_ns_dtype="float32", eps=1e-4, weight_decay=0.1)


def _matrices_in_model() -> int:
    """Matrices Muon orthogonalizes in MODEL_CFG, counted from the config: 4 attention projections a
    block, 3 dense FFN weights a dense block, per MoE block E gate, E up and E down matrices."""
    cfg = MODEL_CFG
    return 4 * cfg.n_layers + 3 * cfg.n_dense_layers + 3 * cfg.moe.n_experts * (cfg.n_layers - cfg.n_dense_layers)


class _Counted:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def _valid(microbatches) -> int:
    return sum(int((t != IGNORE_INDEX).sum()) for _, t in microbatches)


def _train(model, batches_of_step, global_counter) -> None:
    """One step's forwards and backwards (whichever microbatches this process holds)."""
    for tokens, targets in batches_of_step:
        loss_sum, n_valid = token_loss_sum(model(tokens), targets)
        microbatch_loss(loss_sum, n_valid, global_counter, model.aux_loss()).backward()


def _worker(state, batches):
    from moetrain.parallel.grad_sync import accumulation, count_global_tokens, resolve_sync_policy
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed

    rank, world, device = init_distributed(ParallelConfig())
    counted = _Counted(muon_module.orthogonalize)
    muon_module.orthogonalize = counted
    out = {}
    for name, shape, ep in CASES:
        pcfg = ParallelConfig(dp_replicate=shape[0], dp_shard=shape[1], ep=ep)
        mesh = JobMesh.from_config(pcfg, world, device)
        model = build_model(MODEL_CFG, pcfg, mesh, device, weights="none")
        load_full_state(model, state)
        optimizer = build_optimizer(model, TRAIN)
        policy = resolve_sync_policy(pcfg, mesh.dims, N_MICRO)
        calls = []
        for step in range(len(batches)):
            microbatches = batches[step][rank]
            global_tokens = count_global_tokens(_valid(microbatches))
            for batch, _is_last in accumulation(model, microbatches, policy):
                _train(model, [batch], global_tokens)
            before = counted.calls
            optimizer.step()
            optimizer.zero_grad()
            calls.append(counted.calls - before)
        params = {n: p.full_tensor().detach().double().numpy() for n, p in model.named_parameters()}
        out[name] = {"calls": calls, "params": params if rank == 0 else None,
                     "state_keys": sorted({k for s in optimizer.state.values() for k in s})}
    return out


def _reference(state, batches) -> tuple[dict[str, torch.Tensor], list[int]]:
    model = Transformer(MODEL_CFG)
    model.load_state_dict(state)
    optimizer = build_optimizer(model, TRAIN)
    counted = _Counted(muon_module.orthogonalize)
    original, muon_module.orthogonalize = muon_module.orthogonalize, counted
    calls = []
    try:
        for ranks in batches:
            global_tokens = sum(_valid(mbs) for mbs in ranks)
            for microbatches in ranks:
                _train(model, microbatches, global_tokens)
            before = counted.calls
            optimizer.step()
            optimizer.zero_grad()
            calls.append(counted.calls - before)
    finally:
        muon_module.orthogonalize = original
    return {n: p.detach().double() for n, p in model.named_parameters()}, calls


@pytest.fixture(scope="module")
def runs():
    state, batches = initial_state(), make_batches(n_micro=N_MICRO)
    reference, reference_calls = _reference(state, batches)
    return run_on_ranks(_worker, 4, state, batches), reference, reference_calls


def test_one_process_orthogonalizes_each_matrix_once(runs):
    _, _, reference_calls = runs
    assert reference_calls == [_matrices_in_model()] * 3


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_parameters_match_one_process_after_three_steps(runs, case):
    results, reference, _ = runs
    params = {n: torch.as_tensor(v) for n, v in results[0][case]["params"].items()}
    err, worst = relative_error(params, reference)
    assert err < BOUND, f"{case}: {worst} off by {err:.2e} of its largest entry"
    initial = initial_state()
    moved = max(float((reference[n] - initial[n].double()).abs().max()) for n in reference)
    assert moved > 1e-3  # the steps changed the weights, so agreement is not trivial


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_newton_schulz_runs_once_per_matrix_in_the_job(runs, case):
    results, _, _ = runs
    per_step = [sum(rank[case]["calls"][step] for rank in results) for step in range(3)]
    assert per_step == [_matrices_in_model()] * 3
    # the work is split: no rank orthogonalizes everything
    assert max(rank[case]["calls"][0] for rank in results) < _matrices_in_model()
    assert results[0][case]["state_keys"] == ["exp_avg", "exp_avg_sq", "momentum_buffer", "step"]
