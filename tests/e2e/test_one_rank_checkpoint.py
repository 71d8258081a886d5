"""One process trains the plain (unwrapped) model, and its checkpoints move to 4 FSDP ranks and back.

A checkpoint written by one process (plain tensors) is restored on 4 ranks (FSDP shards) and on one
process; the full model and optimizer states must be bitwise equal. Then 4 ranks continue and write
a sharded checkpoint, which one process and 4 ranks again restore identically, and one process
finishes the run from it. (Losses after a world-size change continue only approximately until the
loader's order is world-size independent; see docs/training.md.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from moetrain.testing import run_on_ranks


def _restored(args: list[str]) -> dict:
    """Every rank restores the newest checkpoint; rank 0 returns the full states."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import FSDPModule

    from moetrain.checkpoint.layout import latest_complete
    from moetrain.config.job import parse_job_args
    from moetrain.data.dataset import load_training_data
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed
    from moetrain.train.trainer import Trainer

    cfg = parse_job_args(args)
    _, world, device = init_distributed(cfg.parallel)
    trainer = Trainer(cfg, load_training_data(cfg), JobMesh.from_config(cfg.parallel, world, device))
    trainer.restore(latest_complete(Path(cfg.logging.run_dir) / "checkpoints"))
    full = StateDictOptions(full_state_dict=True)
    model = get_model_state_dict(trainer.model, options=full)
    optimizer = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=full)
    # numpy arrays: tensors would travel back through shared memory that dies with the rank.
    flat = {f"model.{k}": v.numpy().copy() for k, v in model.items()}
    for fqn, state in optimizer["state"].items():
        flat.update({f"optim.{fqn}.{k}": torch.as_tensor(v).numpy().copy() for k, v in state.items()})
    return {"step": trainer.step, "wrapped": isinstance(trainer.model, FSDPModule), "state": flat}


def _session(args: list[str], stop_at: int | None) -> tuple[dict | None, dict]:
    """(state restored before training, or None on a fresh run; state restored from what this session wrote)."""
    from moetrain.train import run

    before = _restored(args) if "--checkpoint.resume" in args else None
    stop = [] if stop_at is None else ["--train.stop_at_step", str(stop_at)]
    assert run.main(args + stop) == 0
    return before, _restored(args)


def _assert_same(one: dict, four: dict) -> None:
    assert one["step"] == four["step"]
    assert (one["wrapped"], four["wrapped"]) == (False, True)
    assert one["state"].keys() == four["state"].keys()
    for key, value in one["state"].items():
        assert value.dtype == four["state"][key].dtype and (value == four["state"][key]).all(), key


def test_one_process_checkpoint_resumes_on_four_ranks_and_back(job_args, tmp_path):
    run_dir = tmp_path / "run"

    def args(**overrides):
        return job_args(run_dir, train__steps=6, checkpoint__every=2, **overrides)

    _, one = run_on_ranks(_session, 1, args(), 2)[0]
    four, four_after = run_on_ranks(_session, 4, args(checkpoint__resume=True), 4, timeout=300)[0]
    _assert_same(one, four)
    one_again, _ = run_on_ranks(_session, 1, args(checkpoint__resume=True), None)[0]
    assert one_again["step"] == 4
    _assert_same(one_again, four_after)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in losses.values())
