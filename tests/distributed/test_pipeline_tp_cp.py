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
from split_parity_support import (
    LR,
    MODELS,
    N_STEPS,
    SEQ,
    check_case,
    initial_state,
    packed_batch,
    reference_run,
)
from split_trainer_support import run_layouts

from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.data.packing import IGNORE_INDEX, Batch

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


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[dict, dict]]:
    """layout -> (the ranks' merged result, the float64 reference); the 4 ranks forked once for every layout."""
    jobs, references = [], {}
    for index, (name, (model, parallel)) in enumerate(LAYOUTS.items()):
        state, batches = initial_state(model_config(model), seed=index), make_batches(model, seed=index)
        references[name] = reference_run(model_config(model), state, batches)
        jobs.append((job_config(model, parallel), state, batches))
    return {name: (merged, references[name]) for name, merged in zip(LAYOUTS, run_layouts(jobs), strict=True)}


@pytest.mark.parametrize("name", LAYOUTS)
def test_pipeline_stages_split_over_tensor_or_context_ranks_equal_one_float64_process(runs, name):
    result, reference = runs[name]
    assert result["grads"].keys() == reference["grads"].keys()  # every parameter has its gradient, once
    check_case(result, reference)
