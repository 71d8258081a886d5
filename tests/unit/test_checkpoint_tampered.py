"""Pruning after a fallback resume, and small state that matches its manifest but not what moetrain writes.

The references: which step directories a save leaves (listed on disk), and that every tampered file
gives one ConfigError line naming the file, raised before a tensor is read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from test_checkpoint_integrity import _model_and_optimizer, _rewrite_manifest, _save, _tensor_file

from moetrain.checkpoint.checkpointer import Checkpointer
from moetrain.checkpoint.layout import (
    META_FILE,
    TRAINER_FILE,
    TRAINER_TENSORS_FILE,
    CheckpointRef,
    latest_complete,
    list_complete,
    prune,
    step_dir_name,
)
from moetrain.checkpoint.manifest import verify
from moetrain.checkpoint.state import TENSOR_REF, capture_rng_state
from moetrain.checkpoint.storage import load_checkpoint, save_checkpoint, saved_intra_op_threads
from moetrain.config.checkpoint import CheckpointConfig
from moetrain.config.job import JobConfig
from moetrain.errors import ConfigError


class _State:
    """What the Checkpointer saves of a trainer, with the trainer's keys."""

    def __init__(self, seed: int):
        self.cfg = JobConfig()
        self.model, self.optimizer = _model_and_optimizer(seed)

    def trainer_state(self):
        return {"skipped_steps": 0, "tokens_seen": 10, "seed": 0}

    def per_rank_state(self):
        return {"loader": {"cursor": 3, "seed": 0}, "rng": capture_rng_state()}


def _steps(root: Path) -> list[int]:
    return [ref.step for ref in list_complete(root)]


def _damage(ref: CheckpointRef) -> None:
    path = _tensor_file(ref)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("keep_last", [1, 2])
def test_a_save_after_a_fallback_keeps_the_resume_point_and_what_it_wrote(tmp_path, keep_last):
    root = tmp_path / "ckpts"
    state = _State(0)
    writer = Checkpointer(root, CheckpointConfig(every=2, keep_last=5, resume="auto"), 10, "run")
    for step in (2, 4):
        writer.maybe_save(step, state)
    _damage(latest_complete(root))  # the newest (step 4) is damaged
    resumed = Checkpointer(root, CheckpointConfig(every=3, keep_last=keep_last, resume="auto"), 10, "run")
    assert resumed.resume_point().step == 2
    resumed.maybe_save(3, state)  # another cadence: a step below the damaged one
    assert _steps(root) == [2, 3]  # the damaged step 4 went first; 2 (resumed from) and 3 (just written) stay
    for step in _steps(root):
        assert verify(CheckpointRef(step, root / step_dir_name(step)))[1] is None
    resumed.maybe_save(6, state)
    assert _steps(root) == ([2, 6] if keep_last == 1 else [2, 3, 6])
    again = Checkpointer(root, CheckpointConfig(every=3, keep_last=keep_last, resume="auto"), 10, "run")
    assert again.resume_point().step == 6


def test_prune_deletes_known_damaged_older_checkpoints_before_intact_ones(tmp_path):
    root = tmp_path / "ckpts"
    for step in (1, 2, 3, 5):
        _save(root, step)
    assert prune(root, keep_last=3, written=5, protect=(2,), damaged=(3,)) == [3]
    assert _steps(root) == [1, 2, 5]


def _tamper(ref: CheckpointRef, name: str, content: bytes) -> None:
    (ref.path / name).write_bytes(content)
    _rewrite_manifest(ref)


def _trainer_json(ref: CheckpointRef) -> dict:
    return json.loads((ref.path / TRAINER_FILE).read_text())


def _load(ref: CheckpointRef, like: bool = False) -> None:
    state = _State(1)
    if like:  # the loading trainer's own keys and types
        load_checkpoint(ref, state.model, state.optimizer, like=(state.trainer_state(), state.per_rank_state()))
    else:
        load_checkpoint(ref, state.model, state.optimizer)


def _saved(tmp_path: Path) -> CheckpointRef:
    state = _State(0)
    return save_checkpoint(tmp_path, 2, state.model, state.optimizer, state.trainer_state(),
                           state.per_rank_state(), keep_last=2, config=state.cfg.to_dict())


def _one_line(err: pytest.ExceptionInfo, *names: str) -> None:
    text = str(err.value)
    assert "\n" not in text and all(name in text for name in names), text


@pytest.mark.parametrize("case", ["string step", "string counter", "missing counter", "short torch rng",
                                  "short python rng", "rng not a state", "cursor negative", "ranks not a list",
                                  "rank not an object", "deep nesting", "tensor ref not a string"])
def test_tampered_trainer_state_is_one_line(tmp_path, case):
    ref = _saved(tmp_path)
    state = _trainer_json(ref)
    tensors = TRAINER_TENSORS_FILE
    if case == "string step":
        state["step"] = "2"
    elif case == "string counter":
        state["tokens_seen"] = "many"
    elif case == "missing counter":
        del state["skipped_steps"]
    elif case == "short torch rng":
        _tamper(ref, tensors, _short_torch_rng(ref))
    elif case == "short python rng":
        state["ranks"][0]["rng"]["python"][1] = state["ranks"][0]["rng"]["python"][1][:10]
    elif case == "rng not a state":
        state["ranks"][0]["rng"] = 7
    elif case == "cursor negative":
        state["ranks"][0]["loader"]["cursor"] = -4
    elif case == "ranks not a list":
        state["ranks"] = {"0": {}}
    elif case == "rank not an object":
        state["ranks"] = ["x"]
    elif case == "tensor ref not a string":
        state["ranks"][0]["rng"]["torch"] = {TENSOR_REF: [1]}
    if case == "deep nesting":
        body = b"[" * 100_000 + b"]" * 100_000
    else:
        body = json.dumps(state).encode()
    if case != "short torch rng":
        _tamper(ref, TRAINER_FILE, body)
    with pytest.raises(ConfigError) as err:
        _load(ref, like=case in ("string counter", "missing counter"))
    _one_line(err, str(ref.path))


def _short_torch_rng(ref: CheckpointRef) -> bytes:
    import safetensors.torch
    tensors = safetensors.torch.load_file(ref.path / TRAINER_TENSORS_FILE)
    key = next(k for k in tensors if k.endswith("rng.torch"))
    tensors[key] = tensors[key][:100].clone()
    out = ref.path / "short.safetensors"
    safetensors.torch.save_file(tensors, out)
    data = out.read_bytes()
    out.unlink()
    return data


@pytest.mark.parametrize("content", [b"[1, 2]", b"\xff\xfe\x00binary", b'"text"'])
def test_a_meta_json_that_is_not_an_object_is_one_line(tmp_path, content):
    ref = _saved(tmp_path)
    _tamper(ref, META_FILE, content)
    checked, problem = verify(ref)
    assert problem is None
    with pytest.raises(ConfigError) as err:
        saved_intra_op_threads(checked)
    _one_line(err, META_FILE)


def _edit_sharding(header: dict, case: str) -> None:
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    if case == "bad dtype":
        header["model.0.bias"]["dtype"] = "I64"  # 8 bytes an element: the data offsets no longer fit
        return
    if case == "entry without offsets":
        info["model.0.weight"] = {}
    elif case == "tensor without entry":
        del info["model.0.weight"]
    elif case == "string offset":
        info["model.0.weight"] = {"saved_offsets": ["a", 0]}
    header["__metadata__"]["DCP_SHARDING_INFO"] = "{not json" if case == "not json" else json.dumps(info)


@pytest.mark.parametrize("case", ["entry without offsets", "tensor without entry", "string offset", "not json",
                                  "bad dtype"])
def test_a_broken_sharding_entry_in_a_tensor_header_is_one_line(tmp_path, caplog, case):
    ref = _saved(tmp_path)
    path = _tensor_file(ref)
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    _edit_sharding(header, case)
    encoded = json.dumps(header).encode()
    encoded += b" " * ((8 - len(encoded) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + size:])
    _rewrite_manifest(ref)
    with pytest.raises(ConfigError) as err:
        _load(ref)
    _one_line(err, str(ref.path))
    # DCP logs its reader's failure with the traceback before raising: none may be logged.
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
