"""Muon under FSDP 4, HSDP 2x2 and expert parallelism on 4 gloo ranks against one process, with Newton–Schulz counted.

One 4-rank run serves every case: the parity grid's tiny 2-dense + 2-MoE transformer, its uneven
microbatches (2 per rank and step), 3 optimizer steps of `train.optimizer = "muon"` (Newton–Schulz in
float32, AdamW on the rest) built by `build_optimizer`. The reference is the same model and optimizer in this process,
unsharded, on the whole global batch: after 3 steps every parameter must match within 1e-6 of its
largest entry (float32), and in every step the ranks together must run Newton–Schulz exactly once
per matrix (counted by wrapping `moetrain.train.muon.orthogonalize` on every rank), no more (each
rank orthogonalizing everything) and no fewer.

QK-clip (τ below the largest logits, so some heads are clipped after every step) runs in every case and in
the reference. Under PP 2 x FSDP 2 the run is torch's pipeline schedule (`PipelineStep`, each data rank
reading two ranks' microbatches); each stage orthogonalizes its own matrices, split over its 2 FSDP ranks,
and clips its own heads with the maxima taken over those ranks. Microbatches have one shape [3, 8] (a
pipeline's stages exchange fixed shapes): the parity data padded with ignored targets.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from parity_support import MODEL_CFG, initial_state, load_full_state, make_batches, relative_error

from moetrain.config.parallel import ParallelConfig
from moetrain.config.train import TrainConfig
from moetrain.data.packing import IGNORE_INDEX, Batch
from moetrain.model.transformer import Transformer
from moetrain.testing import run_on_ranks
from moetrain.train import muon as muon_module
from moetrain.train.build import build_model
from moetrain.train.loss import microbatch_loss, token_loss_sum
from moetrain.train.optim import build_optimizer
from moetrain.train.qk_clip import QKClip

BOUND = 1e-6
N_MICRO = 2  # uneven microbatches per rank and step (the parity grid's data, fewer of them: a faster test)
ROWS, SEQ = 3, 8  # every microbatch padded to this shape
TAU = 3.0  # below the largest logits of the parity model: heads are clipped after every step
# (name, (dp_replicate, dp_shard), ep, pp). EP 2 under HSDP: experts whole on each rank (left in place across the
# EP and expert-FSDP dimensions) and split over the replicate dimension; EP 2 x FSDP 2 without replication
# leaves them entirely in place, as one process does (checked by hand, not repeated here for time).
CASES = [("fsdp4", (1, 4), 1, 1), ("hsdp2x2", (2, 2), 1, 1), ("hsdp2x2_ep2", (2, 2), 2, 1),
         ("pp2_fsdp2", (1, 2), 1, 2)]
# A large AdamW epsilon keeps the AdamW parameters' update a smooth function of the gradient: with 1e-8, an
# entry whose gradient is summation noise takes ±lr either way on its sign.
TRAIN = TrainConfig(optimizer="muon", lr=0.02, muon_ns_dtype="float32", eps=1e-4, weight_decay=0.1)


def matrices_in_model(cfg=MODEL_CFG) -> int:
    """Matrices Muon orthogonalizes in a model of `cfg`, counted from the config: 4 attention projections a block,
    3 dense FFN weights a dense block, per MoE block E gate, E up and E down matrices and a shared expert's 3."""
    moe_blocks = cfg.n_layers - cfg.n_dense_layers
    return 4 * cfg.n_layers + 3 * cfg.n_dense_layers + moe_blocks * 3 * (cfg.moe.n_experts + cfg.moe.n_shared_experts)


class CountedCalls:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def padded_batches() -> list[list[list[Batch]]]:
    """The parity grid's uneven microbatches, [step][rank][microbatch], each padded to [ROWS, SEQ] (ignored targets)."""
    out = []
    for ranks in make_batches(n_micro=N_MICRO):
        out.append([])
        for microbatches in ranks:
            padded = []
            for tokens, targets in microbatches:
                rows, seq = tokens.shape
                full_tokens = torch.zeros(ROWS, SEQ, dtype=tokens.dtype)
                full_targets = torch.full((ROWS, SEQ), IGNORE_INDEX, dtype=targets.dtype)
                full_tokens[:rows, :seq], full_targets[:rows, :seq] = tokens, targets
                padded.append(Batch(full_tokens, torch.arange(SEQ).expand(ROWS, SEQ).clone(),
                                    torch.zeros(ROWS, SEQ, dtype=torch.long), full_targets))
            out[-1].append(padded)
    return out


def _valid(microbatches: list[Batch]) -> int:
    return sum(batch.n_valid_targets for batch in microbatches)


def _train(model, batches_of_step: list[Batch], global_counter) -> None:
    """One step's forwards and backwards (whichever microbatches this process holds)."""
    for batch in batches_of_step:
        logits = model(batch.tokens, positions=batch.positions, document_ids=batch.document_ids)
        loss_sum, n_valid = token_loss_sum(logits, batch.targets)
        microbatch_loss(loss_sum, n_valid, global_counter, model.aux_loss()).backward()


def _pipeline_case(state, batches, pcfg: ParallelConfig, world: int, device):
    """(model, QK-clip, one step's forwards and backwards) of the PP case."""
    from moetrain.config.job import JobConfig
    from moetrain.parallel.mesh import JobMesh
    from moetrain.train.build import build_pipeline
    from moetrain.train.pipeline_step import PipelineStep

    mesh = JobMesh.from_config(pcfg, world, device)
    per_data_rank = len(batches[0]) // mesh.data_world
    cfg = JobConfig(model=MODEL_CFG, parallel=pcfg, train=replace(TRAIN, grad_accum=N_MICRO * per_data_rank,
                                                                   microbatch_size=ROWS))
    cfg.data.seq_len = SEQ
    pipeline = PipelineStep(cfg, mesh, build_pipeline(cfg, mesh, weights="none"))
    load_full_state(pipeline.model, state)

    def train(step: int) -> None:
        ranks = batches[step][mesh.data_rank * per_data_rank:(mesh.data_rank + 1) * per_data_rank]
        microbatches = [batch for rank in ranks for batch in rank]
        pipeline.run(microbatches, pipeline.count_global_tokens(microbatches))

    return pipeline.model, QKClip(pipeline.model, TAU, pipeline.data_max, pipeline.pipeline_max), train


def _data_parallel_case(state, batches, pcfg: ParallelConfig, world: int, device, rank: int):
    """(model, QK-clip, one step's forwards and backwards) of an FSDP/HSDP/EP case."""
    from moetrain.parallel.grad_sync import accumulation, count_global_tokens, resolve_sync_policy
    from moetrain.parallel.mesh import JobMesh

    mesh = JobMesh.from_config(pcfg, world, device)
    model = build_model(MODEL_CFG, pcfg, mesh, device, weights="none")
    load_full_state(model, state)
    policy = resolve_sync_policy(pcfg, mesh.dims, N_MICRO)

    def train(step: int) -> None:
        microbatches = batches[step][rank]
        global_tokens = count_global_tokens(_valid(microbatches))
        for batch, _is_last in accumulation(model, microbatches, policy):
            _train(model, [batch], global_tokens)

    return model, QKClip(model, TAU), train


def _worker(state, batches):
    from moetrain.parallel.process_group import init_distributed

    rank, world, device = init_distributed(ParallelConfig())
    counted = CountedCalls(muon_module.orthogonalize)
    muon_module.orthogonalize = counted
    out = {}
    for name, shape, ep, pp in CASES:
        pcfg = ParallelConfig(dp_replicate=shape[0], dp_shard=shape[1], ep=ep, pp=pp)
        if pp > 1:
            model, clip, train = _pipeline_case(state, batches, pcfg, world, device)
        else:
            model, clip, train = _data_parallel_case(state, batches, pcfg, world, device, rank)
        optimizer = build_optimizer(model, TRAIN)
        calls, clipped = [], []
        for step in range(len(batches)):
            clip.arm()
            train(step)
            before = counted.calls
            optimizer.step()
            calls.append(counted.calls - before)
            clipped.append(int((clip.clip() > TAU).sum()))
            optimizer.zero_grad()
        params = {n: p.full_tensor().detach().double().numpy() for n, p in model.named_parameters()}
        # Under PP each stage's first data rank reports its stage's parameters.
        reports = rank == 0 or (pp > 1 and rank == world // pp)
        out[name] = {"calls": calls, "params": params if reports else None, "clipped": clipped,
                     "state_keys": sorted({k for s in optimizer.state.values() for k in s})}
    return out


def _reference(state, batches) -> tuple[dict[str, torch.Tensor], list[int], list[int]]:
    model = Transformer(MODEL_CFG)
    model.load_state_dict(state)
    optimizer = build_optimizer(model, TRAIN)
    clip = QKClip(model, TAU)
    counted = CountedCalls(muon_module.orthogonalize)
    original, muon_module.orthogonalize = muon_module.orthogonalize, counted
    calls, clipped = [], []
    try:
        for ranks in batches:
            global_tokens = sum(_valid(mbs) for mbs in ranks)
            clip.arm()
            for microbatches in ranks:
                _train(model, microbatches, global_tokens)
            before = counted.calls
            optimizer.step()
            calls.append(counted.calls - before)
            clipped.append(int((clip.clip() > TAU).sum()))
            optimizer.zero_grad()
    finally:
        muon_module.orthogonalize = original
    return {n: p.detach().double() for n, p in model.named_parameters()}, calls, clipped


@pytest.fixture(scope="module")
def runs():
    state, batches = initial_state(), padded_batches()
    reference, reference_calls, reference_clipped = _reference(state, batches)
    return run_on_ranks(_worker, 4, state, batches, timeout=300), reference, (reference_calls, reference_clipped)


def test_one_process_orthogonalizes_each_matrix_once_and_clips_heads(runs):
    _, _, (reference_calls, reference_clipped) = runs
    assert reference_calls == [matrices_in_model()] * 3
    # QK-clip acts in every step, on some heads only: the sharded runs must take the same per-head maxima.
    assert all(0 < n < MODEL_CFG.n_layers * MODEL_CFG.n_heads for n in reference_clipped)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_parameters_match_one_process_after_three_steps(runs, case):
    results, reference, _ = runs
    params = {n: torch.as_tensor(v) for rank in results if rank[case]["params"] is not None
              for n, v in rank[case]["params"].items()}
    assert params.keys() == reference.keys()
    err, worst = relative_error(params, reference)
    assert err < BOUND, f"{case}: {worst} off by {err:.2e} of its largest entry"
    initial = initial_state()
    moved = max(float((reference[n] - initial[n].double()).abs().max()) for n in reference)
    assert moved > 1e-3  # the steps changed the weights, so agreement is not trivial


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_newton_schulz_runs_once_per_matrix_in_the_job(runs, case):
    results, _, (_, reference_clipped) = runs
    per_step = [sum(rank[case]["calls"][step] for rank in results) for step in range(3)]
    assert per_step == [matrices_in_model()] * 3
    # the work is split: no rank orthogonalizes everything
    assert max(rank[case]["calls"][0] for rank in results) < matrices_in_model()
    assert results[0][case]["state_keys"] == ["exp_avg", "exp_avg_sq", "momentum_buffer", "step"]
    # Each rank clips the heads it holds, and the maxima it returns for the log cover the whole model: under PP
    # every stage's ranks see every layer's row, the other stages' filled in over the pipeline ranks.
    assert all(rank[case]["clipped"] == reference_clipped for rank in results)
