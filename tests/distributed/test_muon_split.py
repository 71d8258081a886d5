"""Muon and QK-clip under tensor and context parallelism on 4 gloo ranks against one process, Newton–Schulz counted.

One 4-rank run (module fixture) trains every case of `CASES` for 3 steps of `train.optimizer = "muon"`
(Newton–Schulz in float32, AdamW on the rest, built by `build_optimizer`) with QK-clip, the way the trainer
runs a step (`split_parity_support.split_step`: `SequenceSplit`, the vocabulary-parallel loss, the
global-batch balance loss): TP 2 with the data ranks replicated (each matrix split over the tensor ranks
only), FSDP 2 x TP 2 (column-wise matrices `_StridedShard` over the data ranks on top of TP's Shard(0))
and CP 2 x FSDP 2 (CP 2 x TP 2 composes the two; left out for the suite's time), on the split parity grid's
tiny MoE with one key head per query head (QK-clip then scales both the query and the key rows) and a
shared expert (TP-split; the routed experts are not). The reference is the same model and optimizer in
this process, unsharded, on each step's whole global batch. Checked: every parameter after 3 steps within
1e-6 of its largest entry (float32); in every step the ranks together run Newton–Schulz exactly once per
matrix (counted by wrapping `moetrain.train.muon.orthogonalize`), the work split so no rank runs it for
every matrix; every rank's per-head maxima equal the reference's over all heads, so the same heads are
clipped.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from split_parity_support import (
    MODELS,
    N_MICRO,
    initial_state,
    load_full_state,
    make_batches,
    reference_step,
    relative_error,
    split_step,
)
from test_muon_dist import CountedCalls, matrices_in_model

from moetrain.config.train import TrainConfig
from moetrain.model.transformer import Transformer
from moetrain.testing import run_on_ranks
from moetrain.train import muon as muon_module
from moetrain.train.optim import build_optimizer
from moetrain.train.qk_clip import QKClip

WORLD = 4
STEPS = 3
BOUND = 1e-6
MAXIMA_BOUND = 1e-5  # the per-head maxima (float32 logits of a few units) against the reference's
TAU = 2.5  # between the heads' maxima of this model and data: some heads are clipped after every step
MODEL = replace(MODELS["tiny_moe"], n_kv_heads=None)  # one key head per query head: query and key rows scaled
# name -> parallel fields. The data ranks are 4 / (tp x cp).
CASES = {
    "tp2_replicate2": {"tp": 2, "dp_replicate": 2},
    "fsdp2_tp2": {"tp": 2},
    "cp2_fsdp2": {"cp": 2},
}
# A large AdamW epsilon keeps the AdamW parameters' update a smooth function of the gradient (test_muon_dist.py
# uses 1e-4): with 1e-3 the embedding, whose float32 gradient sums differ most under the split, was 1.3e-6 off.
TRAIN = TrainConfig(optimizer="muon", lr=0.02, muon_ns_dtype="float32", eps=1e-2, weight_decay=0.1)


def _data_ranks(fields: dict) -> int:
    return WORLD // (fields.get("tp", 1) * fields.get("cp", 1))


def _steps(optimizer, clip: QKClip, counted: CountedCalls, train, microbatches_of_steps) -> tuple[list[int], list]:
    """Per step `train(microbatches)`, then the optimizer and QK-clip: Newton–Schulz calls and clip maxima per step."""
    calls, maxima = [], []
    for microbatches in microbatches_of_steps:
        clip.arm()
        train(microbatches)
        before = counted.calls
        optimizer.step()
        calls.append(counted.calls - before)
        maxima.append(clip.clip().double().numpy())
        optimizer.zero_grad()
    return calls, maxima


def _worker(state, batches_by_ranks):
    from moetrain.config.parallel import ParallelConfig
    from moetrain.data.packing import Batch
    from moetrain.parallel.context_parallel import SequenceSplit
    from moetrain.parallel.grad_sync import resolve_sync_policy
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed
    from moetrain.train.build import build_model
    from moetrain.train.qk_clip import job_qk_clip

    rank, world, device = init_distributed(ParallelConfig())
    state = {n: torch.from_numpy(t) for n, t in state.items()}
    counted = CountedCalls(muon_module.orthogonalize)
    muon_module.orthogonalize = counted
    out = {}
    for name, fields in CASES.items():
        batches = [[[Batch(*(torch.from_numpy(t) for t in mb)) for mb in ranks] for ranks in step]
                   for step in batches_by_ranks[_data_ranks(fields)]]
        pcfg = ParallelConfig(**fields)
        mesh = JobMesh.from_config(pcfg, world, device)
        model = build_model(MODEL, pcfg, mesh, device, weights="none")
        load_full_state(model, state)
        model.train()
        split, policy = SequenceSplit.of(mesh), resolve_sync_policy(pcfg, mesh.dims, N_MICRO)
        optimizer = build_optimizer(model, TRAIN)
        calls, maxima = _steps(optimizer, job_qk_clip(model, TAU, mesh), counted,
                               functools.partial(split_step, model, split, policy),
                               [step[mesh.data_rank] for step in batches])
        params = {n: p.full_tensor().detach().double().numpy() for n, p in model.named_parameters()}
        out[name] = {"calls": calls, "maxima": maxima, "params": params if rank == 0 else None}
    return out


def _reference(state, batches) -> tuple[dict[str, torch.Tensor], list[int], list]:
    model = Transformer(MODEL)
    model.load_state_dict(state)
    model.train()
    counted = CountedCalls(muon_module.orthogonalize)
    original, muon_module.orthogonalize = muon_module.orthogonalize, counted
    try:
        calls, maxima = _steps(build_optimizer(model, TRAIN), QKClip(model, TAU), counted,
                               functools.partial(reference_step, model), [[mb for rank in step for mb in rank]
                                                                          for step in batches])
    finally:
        muon_module.orthogonalize = original
    return {n: p.detach().double() for n, p in model.named_parameters()}, calls, maxima


@pytest.fixture(scope="module")
def runs():
    state = initial_state(MODEL)
    batches = {ranks: make_batches(MODEL, ranks, steps=STEPS) for ranks in {_data_ranks(f) for f in CASES.values()}}
    references = {ranks: _reference(state, steps) for ranks, steps in batches.items()}
    # numpy, not tensors, to the ranks: the fork server passes each tensor as a file descriptor.
    batches_np = {ranks: [[[tuple(t.numpy() for t in (mb.tokens, mb.positions, mb.document_ids, mb.targets))
                            for mb in rank] for rank in step] for step in steps] for ranks, steps in batches.items()}
    results = run_on_ranks(_worker, WORLD, {n: t.numpy() for n, t in state.items()}, batches_np, timeout=600)
    return results, references, state


def test_one_process_orthogonalizes_each_matrix_once_and_clips_some_heads(runs):
    _, references, _ = runs
    for _, calls, maxima in references.values():
        assert calls == [matrices_in_model(MODEL)] * STEPS
        for step_maxima in maxima:  # QK-clip acts in every step, on some heads only
            assert 0 < int((torch.as_tensor(step_maxima) > TAU).sum()) < step_maxima.size


@pytest.mark.parametrize("case", list(CASES))
def test_parameters_match_one_process_after_three_steps(runs, case):
    results, references, state = runs
    reference = references[_data_ranks(CASES[case])][0]
    params = {n: torch.as_tensor(v) for n, v in results[0][case]["params"].items()}
    assert params.keys() == reference.keys()
    err, worst = relative_error(params, reference)
    assert err < BOUND, f"{case}: {worst} off by {err:.2e} of its largest entry"
    moved = max(float((reference[n] - state[n].double()).abs().max()) for n in reference)
    assert moved > 1e-3  # the steps changed the weights, so agreement is not trivial


@pytest.mark.parametrize("case", list(CASES))
def test_newton_schulz_runs_once_per_matrix_and_every_rank_clips_the_reference_heads(runs, case):
    results, references, _ = runs
    per_step = [sum(rank[case]["calls"][step] for rank in results) for step in range(STEPS)]
    assert per_step == [matrices_in_model(MODEL)] * STEPS
    assert max(rank[case]["calls"][0] for rank in results) < matrices_in_model(MODEL)  # the work is split
    reference_maxima = references[_data_ranks(CASES[case])][2]
    for rank in results:  # every head's maximum on every rank (all heads, under TP too), as one process has it
        for step, (maxima, expected) in enumerate(zip(rank[case]["maxima"], reference_maxima, strict=True)):
            assert maxima.shape == expected.shape
            err = float(abs(maxima - expected).max()) / float(abs(expected).max())
            assert err < MAXIMA_BOUND, (case, step, err)
            assert ((maxima > TAU) == (expected > TAU)).all(), (case, step)
