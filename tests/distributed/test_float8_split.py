"""train.float8 under pipeline parallelism: the Trainer's own step on PP 2 x FSDP 2 against one process with float8.

Both sides run the Trainer (split_trainer_support's worker: fixed packed microbatches, SGD at a constant rate, 2
steps of 3 microbatches per data rank) with train.float8 = "tensorwise" and param_dtype float32, so FSDP
all-gathers each stage's converted weights in float8 with the scale of the whole weight (precomputed after each
optimizer step): one process runs the same global batch, each microbatch its own forward.

The bound: a pipeline stage runs a microbatch's rows through its layers as one process runs them, so every
float8 cast sees the same tensor (the same amax, the same scale) and every float8 weight is the one one process
casts from the same float32 master. What differs is float32 rounding alone: the loss sums across data ranks and
the reduce-scatter of the gradients (~1e-7 relative), which after an optimizer step can move a weight element
across a float8 rounding boundary. So the losses, step-0 gradients and final parameters agree within 1e-5
relative, the FSDP float8 bound (test_float8_dist.py), not within the float8 error itself (~2^-4).

The checkpoint: each stage part is converted, but the rank's whole part (which shares the stages' modules) is what
the trainer saves, so the state-dict hook that turns a float8-gathered weight back into its plain float32 shard
must sit on the converted linears: a checkpoint of a PP 2 x FSDP 2 float8 model, read into a plain model in one
process (as export-hf does), holds the float32 masters bit for bit.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from split_parity_support import TINY_MOE, initial_state, load_full_state
from split_trainer_support import MICRO, job_config, make_batches, trainer_worker

from moetrain.model.transformer import Transformer
from moetrain.parallel.mesh import JobMesh
from moetrain.testing.multirank import run_on_ranks

pytest.importorskip("torchao.float8")

WORLD = 4
CFG = replace(TINY_MOE, vocab_size=259)  # the byte tokenizer's vocabulary (the trainer's data)
LAYOUT = {"pp": 2, "dp_shard": 2}
RECIPE = "tensorwise"


def float8_job(parallel: dict, grad_accum: int = MICRO):
    cfg = job_config(CFG, parallel)
    cfg.train.float8, cfg.train.grad_accum = RECIPE, grad_accum
    return cfg.validate()


def pipeline_checkpoint(cfg, state: dict, directory: str) -> tuple[str, list[str]]:
    """Save a PP x FSDP float8 pipeline holding `state`; the checkpoint's path and the float8-gathered weights."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from moetrain.checkpoint.storage import save_checkpoint
    from moetrain.train.build import build_pipeline

    job = JobMesh.from_config(cfg.parallel, dist.get_world_size(), "cpu")
    pipeline = build_pipeline(cfg, job, weights="none")
    load_full_state(pipeline.model, {name: torch.from_numpy(value) for name, value in state.items()})
    gathered = [name for name, p in pipeline.model.named_parameters()
                if isinstance(p.to_local(), WeightWithDynamicFloat8CastTensor)]
    optimizer = torch.optim.SGD(pipeline.model.parameters(), lr=0.1)
    ref = save_checkpoint(directory, 1, pipeline.model, optimizer, {}, {}, 1)
    return str(ref.path), gathered


def worker(runs: list, checkpoint_cfg, state: dict, directory: str) -> dict:
    results = trainer_worker(runs)
    if dist.get_world_size() == 1:
        return {"runs": results}
    return {"runs": results, "checkpoint": pipeline_checkpoint(checkpoint_cfg, state, directory)}


def merge(per_rank: list[dict]) -> dict:
    """The ranks' results of the one run: losses of rank 0, gradients and parameters of every stage."""
    merged = {"losses": per_rank[0]["runs"][0]["losses"], "grads": {}, "params": {}}
    for rank in sorted(per_rank, key=lambda r: r["runs"][0]["first"]):  # the first stage's embedding last
        for what in ("grads", "params"):
            merged[what].update(rank["runs"][0][what])
    return merged


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def test_float8_under_pp_x_fsdp_equals_one_process_and_checkpoints_plain_weights(tmp_path):
    from moetrain.checkpoint.layout import CheckpointRef
    from moetrain.checkpoint.storage import load_model_weights

    state = {name: t.numpy() for name, t in initial_state(CFG).items()}
    batches = make_batches(CFG, 2, seed=5)  # [step][data rank][microbatch]
    split_cfg = float8_job(LAYOUT)
    one = run_on_ranks(worker, 1, [(float8_job({"dp_shard": 1}, 2 * MICRO), state,
                                    [[[mb for rank in step for mb in rank]] for step in batches])],
                       None, state, str(tmp_path))
    split = run_on_ranks(worker, WORLD, [(split_cfg, state, batches)], split_cfg, state, str(tmp_path), timeout=600)
    expected, got = merge(one), merge(split)
    for step, (a, b) in enumerate(zip(got["losses"], expected["losses"], strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, got["losses"], expected["losses"])
    assert got["grads"].keys() == expected["grads"].keys() and got["params"].keys() == expected["params"].keys()
    errors = {f"grad {n}": relative(g, expected["grads"][n]) for n, g in got["grads"].items()}
    errors |= {f"param {n}": relative(p, expected["params"][n]) for n, p in got["params"].items()}
    worst = max(errors, key=errors.__getitem__)
    print(f"losses {got['losses']} vs {expected['losses']}; worst {worst}: {errors[worst]:.2e}")
    assert errors[worst] <= 1e-5, (worst, errors[worst])
    # Every stage's converted weights gathered in float8 (the attention and dense/shared SwiGLU linears).
    path, gathered = split[0]["checkpoint"]
    gathered = sorted({name for rank in split for name in rank["checkpoint"][1]})
    assert len(gathered) == 14 and {n.split(".")[1] for n in gathered} == {"0", "1"}, gathered
    plain = Transformer(CFG)
    load_model_weights(CheckpointRef(1, Path(path)), plain)
    for name, param in plain.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param.detach(), torch.from_numpy(state[name])), name
