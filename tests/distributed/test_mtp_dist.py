"""Multi-token prediction under FSDP 2 x EP 2 (4 gloo ranks) against one float64 process.

The tiny parity model of tests/distributed/parity_support.py with one MTP module (whose block is MoE, so its
experts are split over the EP ranks too) trains on packed microbatches of several documents, uneven over the
ranks; the step's loss is main + λ/D Σ_k CE_k with the MTP targets counted over every rank. The
gradient of every parameter (main and MTP) after one step, gathered, must equal the float64 single-process
gradient of the same global objective within 1e-5 of the largest entry, and so must the logged MTP loss.

Under PP 2 x FSDP 2 (4 gloo ranks, torch's 1F1B schedule through `PipelineStep`) the MTP module runs in the
last stage with its copy of the embedding: the same check on microbatches of one shape (2 rows each, a
pipeline's fixed shapes), the step's MTP targets counted as the reference counts them, the first stage's
embedding gradient holding the copy's part, and the copy equal to the first stage's weights after a step.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from parity_support import MODEL_CFG, initial_state, load_full_state, relative_error

from moetrain.config.parallel import ParallelConfig
from moetrain.data.packing import IGNORE_INDEX, Batch, sequence_fields
from moetrain.model.transformer import Transformer
from moetrain.testing import run_on_ranks
from moetrain.train.build import build_model
from moetrain.train.loss import microbatch_loss, mtp_loss_term, mtp_valid_counts, token_loss_sum

WORLD, LAMBDA, EOS, PAD = 4, 0.3, 46, 47
CFG = replace(MODEL_CFG, mtp_depth=1, moe=replace(MODEL_CFG.moe, aux_loss_coef=0.0))


def packed_microbatches(seed: int = 0, n_rows: int | None = None) -> list[list[Batch]]:
    """[rank][microbatch]: 1-2 rows (or `n_rows`) of 12 tokens, documents of random length (EOS), the last row of
    rank 3 PAD."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rank in range(WORLD):
        microbatches = []
        for micro in range(2):
            rows = []
            for _ in range(n_rows or 1 + (rank + micro) % 2):
                window = torch.randint(0, EOS, (13,), generator=gen)
                window[torch.rand(13, generator=gen) < 0.2] = EOS
                if rank == 3 and micro == 1:
                    window[7:] = PAD
                rows.append(sequence_fields(window, EOS, PAD))
            microbatches.append(Batch(*(torch.stack([r[k] for r in rows])
                                        for k in ("tokens", "positions", "document_ids", "targets"))))
        out.append(microbatches)
    return out


def step_objective(model, microbatches: list[Batch], main_tokens: int, mtp_counts: list[int]):
    """Backward the trainer's microbatch objectives; return this process's part of the logged MTP loss."""
    logged = 0.0
    for batch in microbatches:
        logits, mtp_logits = model(batch.tokens, positions=batch.positions, document_ids=batch.document_ids,
                                   mtp=True)
        loss_sum, n_valid = token_loss_sum(logits, batch.targets)
        term, part = mtp_loss_term(mtp_logits, batch.targets, batch.document_ids, mtp_counts, LAMBDA)
        (microbatch_loss(loss_sum, n_valid, main_tokens, model.aux_loss()) + term).backward()
        logged += part
    return logged


def local_counts(microbatches: list[Batch]) -> tuple[int, list[int]]:
    main = sum(int((b.targets != IGNORE_INDEX).sum()) for b in microbatches)
    depths = [sum(c) for c in zip(*(mtp_valid_counts(b.targets, b.document_ids, CFG.mtp_depth)
                                    for b in microbatches), strict=True)]
    return main, depths


def _worker(state, batches):
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed

    rank, world, device = init_distributed(ParallelConfig())
    pcfg = ParallelConfig(dp_shard=4, ep=2)
    model = build_model(CFG, pcfg, JobMesh.from_config(pcfg, world, device), device, weights="none")
    load_full_state(model, state)
    main, depths = local_counts(batches[rank])
    counts = torch.tensor([main, *depths], dtype=torch.int64)
    dist.all_reduce(counts)
    logged = torch.tensor([step_objective(model, batches[rank], int(counts[0]), counts[1:].tolist())],
                          dtype=torch.float64)
    dist.all_reduce(logged)
    grads = {n: p.grad.full_tensor().double().numpy() for n, p in model.named_parameters()}
    experts = model.mtp[0].block.moe.experts.w1
    return (grads, float(logged), tuple(experts.to_local().shape)) if rank == 0 else None


def mtp_state(reference: Transformer) -> dict[str, torch.Tensor]:
    """parity_support's weights for the main model; a deterministic draw of its own for the MTP module."""
    state = initial_state(seed=4)
    gen = torch.Generator().manual_seed(5)
    for name, tensor in reference.state_dict().items():
        if name in state:
            continue
        if name.endswith("norm.weight"):
            state[name] = 1 + 0.2 * torch.randn(tensor.shape, generator=gen)
        elif name.endswith("expert_bias"):
            state[name] = torch.zeros(tensor.shape)
        else:
            state[name] = 0.1 * torch.randn(tensor.shape, generator=gen)
    return state


def test_fsdp2_ep2_mtp_gradients_equal_one_float64_process():
    reference = Transformer(CFG).double()
    state = mtp_state(reference)
    load_full_state(reference, state)
    batches = packed_microbatches()
    everything = [b for rank in batches for b in rank]
    main, depths = local_counts(everything)
    want_logged = step_objective(reference, everything, main, depths)
    want = {n: p.grad for n, p in reference.named_parameters()}
    results = run_on_ranks(_worker, WORLD, state, batches, timeout=300)
    grads, logged, local_experts = results[0]
    assert any(n.startswith("mtp.0.block.moe.experts") for n in grads)
    # The MTP block's 4 experts: 2 per EP rank, each EP rank's pair sharded over its 2 expert-FSDP ranks.
    assert local_experts[0] == CFG.moe.n_experts // 4
    error, name = relative_error({n: torch.from_numpy(g) for n, g in grads.items()}, want)
    assert error < 1e-5, (error, name)
    assert abs(logged - want_logged) < 1e-5 * want_logged


def _pipeline_worker(state, batches):
    """PP 2 x FSDP 2: one step through the schedule; each stage's first data rank returns its gradients, the
    MTP loss summed over the ranks, the step's MTP counts and its full embedding after an AdamW step."""
    from moetrain.config.job import JobConfig
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed
    from moetrain.train.build import build_pipeline
    from moetrain.train.optim import build_optimizer
    from moetrain.train.pipeline_step import PipelineStep

    rank, world, device = init_distributed(ParallelConfig())
    pcfg = ParallelConfig(pp=2, dp_shard=2)
    job = JobMesh.from_config(pcfg, world, device)
    per_data_rank = len(batches) // job.data_world
    cfg = JobConfig(model=CFG, parallel=pcfg)
    cfg.data.seq_len = batches[0][0].tokens.shape[1]
    cfg.train.microbatch_size = batches[0][0].tokens.shape[0]
    cfg.train.grad_accum, cfg.train.mtp_loss_weight = per_data_rank * len(batches[0]), LAMBDA
    step = PipelineStep(cfg, job, build_pipeline(cfg, job, weights="none"))
    load_full_state(step.model, state)
    microbatches = [b for r in batches[job.data_rank * per_data_rank:(job.data_rank + 1) * per_data_rank] for b in r]
    totals = step.run(microbatches, step.count_global_tokens(microbatches))
    logged = torch.tensor([totals.mtp_loss], dtype=torch.float64)
    dist.all_reduce(logged)
    grads = {n: p.grad.full_tensor().double().numpy() for n, p in step.model.named_parameters() if p.grad is not None}
    optimizer = build_optimizer(step.model, cfg.train)
    optimizer.step()
    step.after_optimizer_step(optimizer)
    embedding = step.model.tok_embeddings.weight.full_tensor().detach().double().numpy()
    reports = job.data_rank == 0
    return {"grads": grads, "logged": float(logged), "counts": totals.mtp_counts, "embedding": embedding,
            "stage": job.pipeline.get_local_rank()} if reports else None


def test_pp2_fsdp2_mtp_gradients_equal_one_float64_process():
    reference = Transformer(CFG).double()
    state = mtp_state(reference)
    load_full_state(reference, state)
    batches = packed_microbatches(n_rows=2)
    everything = [b for rank in batches for b in rank]
    main, depths = local_counts(everything)
    want_logged = step_objective(reference, everything, main, depths)
    want = {n: p.grad for n, p in reference.named_parameters()}
    results = [r for r in run_on_ranks(_pipeline_worker, WORLD, state, batches, timeout=300) if r is not None]
    assert [r["stage"] for r in results] == [0, 1]
    first, last = results
    # The last stage holds the MTP module and the head; its embedding copy's gradient went to the first stage.
    assert any(n.startswith("mtp.0.") for n in last["grads"]) and not any(n.startswith("mtp.") for n in first["grads"])
    assert "tok_embeddings.weight" in first["grads"] and "tok_embeddings.weight" not in last["grads"]
    grads = {**last["grads"], **first["grads"]}
    error, name = relative_error({n: torch.from_numpy(g) for n, g in grads.items()}, want)
    assert grads.keys() == want.keys() and error < 1e-5, (error, name)
    assert first["counts"] == last["counts"] == depths  # the MTP targets counted over the data-parallel ranks
    assert first["logged"] == last["logged"] and abs(first["logged"] - want_logged) < 1e-5 * want_logged
    # After an optimizer step the copy holds the first stage's new weights.
    assert (first["embedding"] == last["embedding"]).all()
    assert not torch.equal(torch.from_numpy(first["embedding"]), state["tok_embeddings.weight"].double())
