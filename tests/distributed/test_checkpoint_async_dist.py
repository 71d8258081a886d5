"""Asynchronous checkpoint saves of an FSDP-sharded model on 2 gloo ranks: the checkpoint a synchronous save of the
same state writes, the state of the step it was requested at while the ranks keep training (their FSDP collectives
on the default group run while the save's own group is in use), and a failed background write raised on every rank.

References: a synchronous save of the same state (each rank's tensor file compared by content), the model's
full weights gathered when the save was requested, and what is on disk.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from moetrain.checkpoint.checkpointer import Checkpointer
from moetrain.checkpoint.layout import list_complete
from moetrain.checkpoint.state import capture_rng_state
from moetrain.checkpoint.storage import DCP_SHARDING_KEY, load_checkpoint
from moetrain.config.checkpoint import CheckpointConfig
from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.runtime.faults import FAIL_ENV
from moetrain.testing import run_on_ranks

MODEL_CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, n_dense_layers=1,
                        max_seq_len=16, moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, impl="loop"))


class _ShardedState:
    def __init__(self):
        from moetrain.parallel.collectives import rank_and_world
        from moetrain.parallel.mesh import JobMesh
        from moetrain.train.build import build_model

        self.rank, world = rank_and_world()
        pcfg = ParallelConfig(dp_shard=2)
        self.cfg = JobConfig()
        mesh = JobMesh.from_config(pcfg, world, "cpu")
        self.model = build_model(MODEL_CFG, pcfg, mesh, "cpu", seed=1)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.cursor = 0
        self.train_a_step()

    def trainer_state(self):
        return {"skipped_steps": 0, "tokens_seen": self.cursor, "seed": 0}

    def per_rank_state(self):
        return {"loader": {"cursor": self.cursor, "seed": 0}, "rng": capture_rng_state()}

    def train_a_step(self) -> None:
        gen = torch.Generator().manual_seed(10 * self.cursor + self.rank)
        tokens = torch.randint(0, MODEL_CFG.vocab_size, (2, 16), generator=gen)
        self.model(tokens).float().square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.cursor += 1

    def full_weights(self) -> dict[str, torch.Tensor]:
        return {name: p.full_tensor().clone() for name, p in self.model.named_parameters()}


def _per_rank(root: str) -> dict:
    from torch.distributed.tensor import DTensor

    state = _ShardedState()
    assert all(isinstance(p, DTensor) for p in state.model.parameters())
    cfg = CheckpointConfig(every=2, keep_last=5, async_save=True)
    Checkpointer(Path(root) / "sync", CheckpointConfig(every=2, keep_last=5), 100, "run").maybe_save(2, state)
    at_save = state.full_weights()

    # Hold the background write until this rank has trained two more steps (FSDP all-gathers and
    # reduce-scatters on the default group while the save waits on its own group).
    release = threading.Event()
    real_save = dcp.save

    def gated_save(*args, **kwargs):
        assert release.wait(60)
        return real_save(*args, **kwargs)

    dcp.save = gated_save
    try:
        saver = Checkpointer(Path(root) / "async", cfg, 100, "run")
        started = saver.maybe_save(2, state)
        for _ in range(2):
            state.train_a_step()
        now = state.full_weights()
        moved = any(not torch.equal(now[name], at_save[name]) for name in at_save)
        release.set()
        saved = saver.wait()
    finally:
        dcp.save = real_save
    fresh = _ShardedState()
    trainer_state = load_checkpoint(saved, fresh.model, fresh.optimizer)
    loaded = fresh.full_weights()
    same_as_at_save = all(torch.equal(loaded[name], at_save[name]) for name in at_save)

    os.environ[FAIL_ENV] = "4"
    saver.maybe_save(4, state)
    try:
        saver.wait()
        failure = ""
    except OSError as err:
        failure = str(err)
    finally:
        del os.environ[FAIL_ENV]
    saver.close()
    return {"started": str(started.path), "saved": str(saved.path), "moved": moved,
            "same_as_at_save": same_as_at_save, "cursor": trainer_state["ranks"][0]["loader"]["cursor"],
            "failure": failure}


def _content(path: Path) -> tuple[dict, dict]:
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    metadata = header.pop("__metadata__", {})
    metadata = {key: json.loads(value) if key == DCP_SHARDING_KEY else value for key, value in metadata.items()}
    payload = data[8 + length:]
    return metadata, {name: (entry["dtype"], entry["shape"], payload[slice(*entry["data_offsets"])])
                      for name, entry in header.items()}


def test_two_ranks_save_asynchronously_what_a_synchronous_save_writes_and_raise_a_failed_write_on_both(tmp_path):
    results = run_on_ranks(_per_rank, 2, str(tmp_path), timeout=240)
    for result in results:
        assert result["started"] == result["saved"] == str(tmp_path / "async" / "step_00000002")
        assert result["moved"] and result["same_as_at_save"] and result["cursor"] == 1
        assert "checkpoint write of step 4 failed" in result["failure"]
    sync, background = tmp_path / "sync" / "step_00000002", tmp_path / "async" / "step_00000002"
    files = sorted(p.relative_to(sync).as_posix() for p in sync.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(background).as_posix() for p in background.rglob("*") if p.is_file())
    tensor_files = [name for name in files if name.startswith("tensors/")]
    assert len(tensor_files) == 2  # one per rank: each wrote its own shards
    for name in tensor_files:
        assert _content(background / name) == _content(sync / name), name
    assert (background / "trainer.json").read_bytes() == (sync / "trainer.json").read_bytes()
    assert [r.step for r in list_complete(tmp_path / "async")] == [2]
    assert (tmp_path / "async" / ".tmp-step_00000004").is_dir()
