"""Checkpoint safety in one process: nothing unpickled, every file verified first, fallback, config checks.

References are direct: the weights saved, a file's bytes as written, a marker file that only code
run by an unpickler could create.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from moetrain.checkpoint.layout import MANIFEST_FILE, TENSORS_DIR, TRAINER_FILE, CheckpointRef
from moetrain.checkpoint.manifest import newest_intact, verify
from moetrain.checkpoint.state import capture_rng_state, check_resume_config, restore_rng_state
from moetrain.checkpoint.storage import load_checkpoint, load_model_weights, save_checkpoint
from moetrain.config.job import JobConfig
from moetrain.errors import ConfigError


class _MakesMarker:
    """Unpickling this calls os.mkdir(marker): the test's stand-in for arbitrary code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(torch.randn(5, 6)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _save(root: Path, step: int, seed: int = 0, config: JobConfig | None = None) -> tuple[CheckpointRef, dict]:
    model, optimizer = _model_and_optimizer(seed)
    ref = save_checkpoint(root, step, model, optimizer, {"tokens_seen": step * 10},
                          {"rng": capture_rng_state()}, keep_last=5,
                          config=(config or JobConfig()).to_dict())
    return ref, {k: v.clone() for k, v in model.state_dict().items()}


def _tensor_file(ref: CheckpointRef) -> Path:
    (path,) = (ref.path / TENSORS_DIR).glob("*.safetensors")
    return path


def _rewrite_manifest(ref: CheckpointRef) -> None:
    """What someone who can write the directory can do: make the manifest match whatever is there."""
    manifest_path = ref.path / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = {}
    for file in sorted(ref.path.rglob("*")):
        if file.is_file() and file.name != MANIFEST_FILE:
            data = file.read_bytes()
            manifest["files"][file.relative_to(ref.path).as_posix()] = {
                "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest_path.write_text(json.dumps(manifest))


def test_a_checkpoint_holds_no_pickle_and_loads_with_every_unpickler_disabled(tmp_path, monkeypatch):
    ref, weights = _save(tmp_path, 2)
    names = sorted(p.relative_to(ref.path).as_posix() for p in ref.path.rglob("*") if p.is_file())
    assert names == ["config.json", "manifest.json", "meta.json",
                     "tensors/shard-00001-model-00001-of-00001.safetensors", "trainer.json",
                     "trainer_tensors.safetensors"]

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load unpickled something")

    for module, name in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(module, name, refuse)
    model, optimizer = _model_and_optimizer(1)
    state = load_checkpoint(ref, model, optimizer)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert state["step"] == 2 and state["tokens_seen"] == 20 and state["world_size"] == 1
    assert state["ranks"][0]["rng"]["torch"].dtype == torch.uint8


def test_a_crafted_pickle_never_runs_listed_or_not(tmp_path):
    marker = tmp_path / "code-ran"
    older, older_weights = _save(tmp_path / "ckpts", 2, seed=0)
    newer, newer_weights = _save(tmp_path / "ckpts", 4, seed=1)
    crafted = pickle.dumps(_MakesMarker(marker))
    # Where DCP's own format keeps its pickled metadata, and as the optimizer's file: outside
    # the manifest, the newest checkpoint is damaged and the older one is used.
    (newer.path / ".metadata").write_bytes(crafted)
    ref, skipped = newest_intact(tmp_path / "ckpts")
    assert ref.path == older.path and skipped == [f"{newer.path / '.metadata'} is not in the checkpoint's manifest"]
    # Tampered: the manifest rewritten to list the crafted file. It verifies, loads, and nothing runs.
    (newer.path / TENSORS_DIR / ".metadata").write_bytes(crafted)
    _rewrite_manifest(newer)
    ref, skipped = newest_intact(tmp_path / "ckpts")
    assert ref.path == newer.path and skipped == []
    model, optimizer = _model_and_optimizer(3)
    load_checkpoint(ref, model, optimizer)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in newer_weights.items())
    # The small state replaced by the pickle: refused in one line (not JSON), never unpickled.
    trainer_json = (newer.path / TRAINER_FILE).read_bytes()
    (newer.path / TRAINER_FILE).write_bytes(crafted)
    _rewrite_manifest(newer)
    with pytest.raises(ConfigError, match="trainer.json is not valid JSON"):
        load_checkpoint(newest_intact(tmp_path / "ckpts")[0], model, optimizer)
    # A tensor file replaced by the pickle: not safetensors, refused in one line.
    (newer.path / TRAINER_FILE).write_bytes(trainer_json)
    _tensor_file(newer).write_bytes(crafted)
    _rewrite_manifest(newer)
    with pytest.raises(ConfigError, match="is not a readable safetensors file: .*header"):
        load_model_weights(newest_intact(tmp_path / "ckpts")[0], model)
    assert not marker.exists()
    assert pickle.loads(crafted) is None and marker.exists()  # the crafted bytes do run code when unpickled


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_damage_is_found_before_reading_and_the_older_checkpoint_is_used(tmp_path, damage):
    older, older_weights = _save(tmp_path, 2, seed=0)
    newer, _ = _save(tmp_path, 4, seed=1)
    target = _tensor_file(newer)
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) - 7] ^= 0x10  # a bit inside a tensor's payload: still parses, different weights
        target.write_bytes(bytes(data))
        expected = f"{target} does not match its sha256 in the manifest (damaged)"
    elif damage == "truncate":
        target.write_bytes(bytes(data[:-100]))
        expected = f"{target} has {len(data) - 100} bytes, the manifest says {len(data)} (truncated or damaged)"
    elif damage == "delete":
        target.unlink()
        expected = f"{target} is missing"
    else:
        target = newer.path / MANIFEST_FILE
        target.unlink()
        expected = f"{target} is missing"
    ref, skipped = newest_intact(tmp_path)
    assert ref == CheckpointRef(2, older.path, verified=True) and skipped == [expected]
    model, optimizer = _model_and_optimizer(5)
    load_checkpoint(ref, model, optimizer)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in older_weights.items())
    # Loading the damaged one directly is refused in one line naming the file.
    with pytest.raises(ConfigError, match="is damaged: " + str(target).replace(".", r"\.")):
        load_model_weights(newer, model)


def test_the_small_state_round_trips_as_json_and_tensors(tmp_path):
    per_rank = {"loader": {"epoch": np.int64(1), "cursor": 7, "order": (3, 1, 2), "nested": [{"a": None, "b": 1.5}]},
                "rng": capture_rng_state(), "counts": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    model, optimizer = _model_and_optimizer(0)
    ref = save_checkpoint(tmp_path, 1, model, optimizer, {"skipped_steps": 2}, per_rank, keep_last=1)
    state = load_model_weights(ref, model)
    got = state["ranks"][0]
    assert got["loader"] == {"epoch": 1, "cursor": 7, "order": [3, 1, 2], "nested": [{"a": None, "b": 1.5}]}
    assert torch.equal(got["counts"], per_rank["counts"])
    assert torch.equal(got["rng"]["torch"], per_rank["rng"]["torch"])
    restore_rng_state(got["rng"])
    draws = torch.rand(3)
    restore_rng_state(per_rank["rng"])
    assert torch.equal(torch.rand(3), draws)
    with pytest.raises(TypeError, match=r"key 3 cannot be stored"):
        save_checkpoint(tmp_path, 2, model, optimizer, {}, {"loader": {3: "x"}}, keep_last=1)


def test_the_resume_check_names_the_first_differing_field(tmp_path):
    cfg = JobConfig()
    ref, _ = _save(tmp_path, 2, config=cfg)
    ref = verify(ref)[0]
    check_resume_config(ref, cfg)  # the same job
    changed = JobConfig()
    changed.model.moe.impl = "loop"  # same parameters, same function
    changed.model.init_from = "hf:somewhere"
    changed.model.init_scheme = "olmo-megatron"  # initialisation only: the checkpoint replaces the weights
    changed.model.init_scale_embedding = True
    changed.train.steps = cfg.train.steps + 100  # training longer is what resuming is for
    changed.parallel.dp_shard = 2
    check_resume_config(ref, changed)
    for section, field, value in [("model", "dim", 128), ("model.moe", "n_experts", 8), ("train", "seed", 1),
                                  ("data", "seq_len", 256)]:
        bad = JobConfig()
        owner = bad
        for part in section.split("."):
            owner = getattr(owner, part)
        old = getattr(owner, field)
        setattr(owner, field, value)
        with pytest.raises(ConfigError, match=rf"^{section}\.{field} = {value} differs from {old} in checkpoint "):
            check_resume_config(ref, bad)


def test_a_listed_link_is_refused_before_it_is_read(tmp_path):
    older, _ = _save(tmp_path / "ckpts", 2)
    newer, _ = _save(tmp_path / "ckpts", 4, seed=1)
    link = newer.path / "endless"
    link.symlink_to("/dev/zero")  # hashing it would never end
    manifest = json.loads((newer.path / MANIFEST_FILE).read_text())
    manifest["files"]["endless"] = {"sha256": hashlib.sha256(b"").hexdigest(), "bytes": 0}
    (newer.path / MANIFEST_FILE).write_text(json.dumps(manifest))
    ref, skipped = newest_intact(tmp_path / "ckpts")
    assert ref.path == older.path and skipped == [f"{link} is not a regular file"]
