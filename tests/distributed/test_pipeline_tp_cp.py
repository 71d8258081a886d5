"""Pipeline parallelism composed with tensor and context parallelism equals one float64 process.

On 4 gloo ranks, PP 2 x TP 2 and PP 2 x CP 2 run the Trainer's own step (torch's 1F1B schedule over
stages that are each TP- or CP-split, moetrain.train.pipeline_step), fed fixed-shape packed rows whose
documents cross every CP chunk boundary, three microbatches per step with uneven valid-target counts,
one of them without any. The reference is split_parity_support's float64 single process over the same
global batch (the plain accumulation loop, no parallel code), with the same SGD steps: every step's
loss, step 0's full gradients and the final parameters must agree within 1e-5 relative.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from split_parity_support import (
    LR,
    MODELS,
    N_STEPS,
    SEQ,
    check_case,
    initial_state,
    load_full_state,
    packed_batch,
    reference_run,
)
from test_pipeline import FixedLoader, full

from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.data.dataset import load_training_data
from moetrain.data.packing import IGNORE_INDEX, Batch
from moetrain.parallel.mesh import JobMesh
from moetrain.testing.multirank import run_on_ranks
from moetrain.train.trainer import Trainer

WORLD, ROWS, MICRO = 4, 2, 3

# name -> (model, parallel fields): every pipeline stage split over the other dimension's 2 ranks.
LAYOUTS = {
    "pp2_tp2_tiny_moe": ("tiny_moe", {"pp": 2, "tp": 2}),
    "pp2_cp2_tiny_moe": ("tiny_moe", {"pp": 2, "cp": 2}),
    "pp2_tp2_deepseek": ("deepseek_like", {"pp": 2, "tp": 2}),
    "pp2_cp2_deepseek": ("deepseek_like", {"pp": 2, "cp": 2}),
}


def model_config(model: str) -> ModelConfig:
    """split_parity_support's model with the byte tokenizer's vocabulary (the trainer's data), split unevenly by TP."""
    return replace(MODELS[model], vocab_size=259)


def job_config(model: str, parallel: dict) -> JobConfig:
    cfg = JobConfig(model=model_config(model))
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    cfg.data.seq_len, cfg.data.max_documents, cfg.data.heldout_fraction = SEQ, 8, 0.0
    cfg.train.microbatch_size, cfg.train.grad_accum, cfg.train.steps = ROWS, MICRO, N_STEPS
    cfg.train.warmup_steps, cfg.train.lr, cfg.train.schedule, cfg.train.grad_clip = 0, LR, "constant", 0.0
    cfg.train.sample_tokens, cfg.logging.progress_bar = 0, False
    return cfg.validate()


def make_batches(model: str, seed: int) -> list[list[list[Batch]]]:
    """[step][data rank (one)][microbatch] [ROWS, SEQ] packed microbatches; step 0's second has no valid target."""
    gen = torch.Generator().manual_seed(seed)
    steps = [[[packed_batch(gen, ROWS, model_config(model)) for _ in range(MICRO)]] for _ in range(N_STEPS)]
    steps[0][0][1].targets.fill_(IGNORE_INDEX)
    return steps


def split_pipeline_worker(runs: list[tuple[JobConfig, dict, list]]) -> list[dict]:
    """Each run's Trainer steps on this rank, from the given full weights, with SGD at the constant rate; this
    rank's step losses, step-0 gradients and final parameters (full tensors of the stages it holds)."""
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
        losses = [trainer.train_step().loss for _ in range(N_STEPS)]
        params = {name: full(p).numpy() for name, p in trainer.model.named_parameters()}
        results.append({"losses": losses, "grads": grads[0], "params": params})
    return results


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[dict, dict]]:
    """layout -> (the ranks' merged result, the float64 reference); the 4 ranks forked once for every layout."""
    jobs, references = [], {}
    for index, (name, (model, parallel)) in enumerate(LAYOUTS.items()):
        state, batches = initial_state(model_config(model), seed=index), make_batches(model, seed=index)
        references[name] = reference_run(model_config(model), state, batches)
        jobs.append((job_config(model, parallel), {n: t.numpy() for n, t in state.items()}, batches))
    per_rank = run_on_ranks(split_pipeline_worker, WORLD, jobs, timeout=600)
    out = {}
    for index, name in enumerate(LAYOUTS):
        merged: dict = {"losses": per_rank[0][index]["losses"], "grads": {}, "params": {}}
        for rank in per_rank:
            for what in ("grads", "params"):
                merged[what].update(rank[index][what])
        out[name] = (merged, references[name])
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_pipeline_stages_split_over_tensor_or_context_ranks_equal_one_float64_process(runs, name):
    result, reference = runs[name]
    assert result["grads"].keys() == reference["grads"].keys()  # every parameter has its gradient, once
    check_case(result, reference)
