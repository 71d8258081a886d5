"""Shared pieces of the parity tests that run the Trainer's own step under TP / CP / PP (no tests here).

The Trainer's own step on 4 gloo ranks (`trainer_worker`, fed fixed packed microbatches through a stand-in
loader, SGD at a constant rate) against one float64 process over the same global batch (`reference_run`: the
plain accumulation loop, no parallel code, with the MTP loss when the model has MTP modules), with
packed rows whose documents cross every CP chunk boundary (split_parity_support's). Spawned ranks import this
module by name.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from split_parity_support import LR, MODELS, SEQ, load_full_state, packed_batch
from test_pipeline import FixedLoader, full

from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.data.dataset import load_training_data
from moetrain.data.packing import IGNORE_INDEX, Batch
from moetrain.model.transformer import Transformer
from moetrain.parallel.mesh import JobMesh
from moetrain.testing.multirank import run_on_ranks
from moetrain.train.global_balance import prepare_global_balance
from moetrain.train.loss import microbatch_loss, mtp_loss_term, mtp_valid_counts, token_loss_sum
from moetrain.train.trainer import Trainer

WORLD, ROWS, MICRO, STEPS, LAMBDA = 4, 2, 3, 2, 0.3


def model_config(model: str, **changes) -> ModelConfig:
    """split_parity_support's model with the byte tokenizer's vocabulary (the trainer's data) and `changes`."""
    return replace(MODELS[model], vocab_size=259, **changes)


def data_ranks(parallel: dict) -> int:
    return WORLD // (parallel.get("pp", 1) * parallel.get("tp", 1) * parallel.get("cp", 1))


def job_config(cfg: ModelConfig, parallel: dict) -> JobConfig:
    job = JobConfig(model=cfg)
    for key, value in parallel.items():
        setattr(job.parallel, key, value)
    job.data.seq_len, job.data.max_documents, job.data.heldout_fraction = SEQ, 8, 0.0
    job.train.microbatch_size, job.train.grad_accum, job.train.steps = ROWS, MICRO, STEPS
    job.train.warmup_steps, job.train.lr, job.train.schedule, job.train.grad_clip = 0, LR, "constant", 0.0
    job.train.sample_tokens, job.logging.progress_bar, job.train.mtp_loss_weight = 0, False, LAMBDA
    return job.validate()


def make_batches(cfg: ModelConfig, n_data_ranks: int, seed: int) -> list[list[list[Batch]]]:
    """[step][data rank][microbatch] [ROWS, SEQ] packed microbatches; step 0's second has no valid target."""
    gen = torch.Generator().manual_seed(seed)
    steps = [[[packed_batch(gen, ROWS, cfg) for _ in range(MICRO)] for _ in range(n_data_ranks)]
             for _ in range(STEPS)]
    steps[0][0][1].targets.fill_(IGNORE_INDEX)
    return steps


def reference_run(cfg: ModelConfig, state: dict, batches) -> dict:
    """One float64 process over each step's whole global batch, each microbatch its own forward: per step the loss
    and the logged MTP loss (with model.mtp_depth > 0); step-0 gradients; final parameters."""
    model = Transformer(cfg)
    model.load_state_dict(state)
    model.double().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict = {"losses": [], "mtp_losses": []}
    for step, ranks in enumerate(batches):
        microbatches = [mb for rank in ranks for mb in rank]
        global_tokens = sum(mb.n_valid_targets for mb in microbatches)
        counts = [sum(c) for c in zip(*(mtp_valid_counts(mb.targets, mb.document_ids, cfg.mtp_depth)
                                         for mb in microbatches), strict=True)]
        prepare_global_balance(model, microbatches)
        loss_total = mtp_total = 0.0
        for mb in microbatches:
            outputs = model(mb.tokens, positions=mb.positions, document_ids=mb.document_ids, mtp=cfg.mtp_depth > 0)
            logits = outputs[0] if cfg.mtp_depth else outputs
            loss_sum, n_valid = token_loss_sum(logits, mb.targets)
            z = model.z_loss_sum(mb.targets != IGNORE_INDEX)
            objective = microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss(), z, aux_is_share=True)
            if cfg.mtp_depth:
                term, part = mtp_loss_term(outputs[1], mb.targets, mb.document_ids, counts, LAMBDA)
                objective, mtp_total = objective + term, mtp_total + part
            objective.backward()
            loss_total += float(loss_sum.detach())
        out["losses"].append(loss_total / global_tokens)
        out["mtp_losses"].append(mtp_total)
        if step == 0:
            out["grads"] = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    return out


def trainer_worker(runs: list[tuple[JobConfig, dict, list]]) -> list[dict]:
    """Each run's Trainer steps on this rank from the given weights with SGD: losses, logged MTP losses, step-0
    gradients and final parameters (full tensors of what the rank holds)."""
    results = []
    for cfg, state, batches in runs:
        job = JobMesh.from_config(cfg.parallel, dist.get_world_size(), "cpu")
        trainer = Trainer(cfg, load_training_data(cfg), job)
        load_full_state(trainer.model, {name: torch.from_numpy(value) for name, value in state.items()})
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=LR)
        trainer.loader = FixedLoader([step[job.data_rank] for step in batches])
        grads: list[dict] = []
        sgd_step = trainer.optimizer.step

        def recording_step(*args, grads=grads, model=trainer.model, sgd_step=sgd_step, **kwargs):
            grads.append({name: full(p.grad).numpy() for name, p in model.named_parameters() if p.grad is not None})
            return sgd_step(*args, **kwargs)

        trainer.optimizer.step = recording_step
        records = [trainer.train_step() for _ in range(STEPS)]
        first = trainer.pipeline is None or trainer.pipeline.pipeline.holds_first
        if not first:  # a pipeline's last stage's copy of the embedding: its gradient went to the first stage's
            grads[0].pop("tok_embeddings.weight", None)
        params = {name: full(p).numpy() for name, p in trainer.model.named_parameters()}
        results.append({"losses": [r.loss for r in records], "mtp_losses": [r.mtp_loss for r in records],
                        "grads": grads[0], "params": params, "first": first})
    return results


def run_layouts(jobs: list[tuple[JobConfig, dict, list]]) -> list[dict]:
    """Every job on the 4 ranks (forked once); per job the ranks' merged result."""
    per_rank = run_on_ranks(trainer_worker, WORLD, [(cfg, {n: t.numpy() for n, t in state.items()}, batches)
                                                    for cfg, state, batches in jobs], timeout=600)
    merged_all = []
    for index in range(len(jobs)):
        merged: dict = {what: per_rank[0][index][what] for what in ("losses", "mtp_losses")}
        merged["grads"], merged["params"] = {}, {}
        for rank in sorted(per_rank, key=lambda r: r[index]["first"]):  # the first stage's embedding last
            for what in ("grads", "params"):
                merged[what].update(rank[index][what])
        merged_all.append(merged)
    return merged_all
