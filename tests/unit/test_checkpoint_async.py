"""Asynchronous checkpoint saves in one process: the same checkpoint as a synchronous save, the state of
the step the save was requested at, one save in flight, failures raised on the training loop.

References: a synchronous save of the same state (its files, the tensor files by content: a
background save writes them with its own writer, DCP's writer writes the synchronous ones), clones of the weights and
RNG state taken when the save was requested, and what is on disk (`list_complete`, `newest_intact`).
The background write is held at a gate (a wrapper around DCP's save) so that the tests decide what
happens while it is in flight instead of racing it.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint_integrity import _model_and_optimizer
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from moetrain.checkpoint.checkpointer import Checkpointer
from moetrain.checkpoint.layout import CheckpointRef, list_complete
from moetrain.checkpoint.manifest import newest_intact, verify
from moetrain.checkpoint.state import capture_rng_state
from moetrain.checkpoint.storage import (
    DCP_SHARDING_KEY,
    _quiet_single_process,
    _UnblockingSafetensorsWriter,
    load_checkpoint,
)
from moetrain.config.checkpoint import CheckpointConfig
from moetrain.config.job import JobConfig
from moetrain.errors import TrainingDiverged
from moetrain.runtime.faults import FAIL_ENV


class _State:
    """What the Checkpointer saves of a trainer, with state that the test changes between saves."""

    def __init__(self, seed: int):
        self.cfg = JobConfig()
        self.model, self.optimizer = _model_and_optimizer(seed)
        self.cursor = 3

    def trainer_state(self):
        return {"skipped_steps": 0, "tokens_seen": 10 * self.cursor, "seed": 0}

    def per_rank_state(self):
        return {"loader": {"cursor": self.cursor, "seed": 0}, "rng": capture_rng_state()}

    def train_a_step(self) -> None:
        """Change weights, moments, RNG and loader position as a training step does."""
        loss = self.model(torch.randn(5, 6)).square().mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.cursor += 1


def _checkpointer(root: Path, asynchronous: bool, keep_last: int = 5) -> Checkpointer:
    return Checkpointer(root, CheckpointConfig(every=2, keep_last=keep_last, async_save=asynchronous), 100, "run")


def _files(ref: CheckpointRef) -> dict[str, bytes]:
    return {p.relative_to(ref.path).as_posix(): p.read_bytes() for p in sorted(ref.path.rglob("*")) if p.is_file()}


def _safetensors_content(data: bytes) -> tuple[dict, dict[str, bytes]]:
    """(header metadata, tensor name -> dtype, shape and raw bytes): what a safetensors file holds.

    DCP writes the header's entries in an order that varies from one process to the next (two
    synchronous saves differ there too), so files are compared by what they hold.
    """
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    payload = data[8 + length:]
    metadata = header.pop("__metadata__", {})
    metadata = {key: json.loads(value) if key == DCP_SHARDING_KEY else value for key, value in metadata.items()}
    tensors = {name: (entry["dtype"], entry["shape"], payload[entry["data_offsets"][0]:entry["data_offsets"][1]])
               for name, entry in header.items()}
    return metadata, tensors


@pytest.fixture
def gate(monkeypatch):
    """Hold every background DCP write until `gate.set()`; `gate.entered` is set when one reaches it."""
    real_save = dcp.save
    release, entered = threading.Event(), threading.Event()

    def gated_save(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            assert release.wait(60), "the test never released the background write"
        return real_save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", gated_save)
    release.entered = entered
    yield release
    release.set()


def test_an_async_save_writes_the_bytes_a_synchronous_save_writes(tmp_path):
    refs = {}
    for asynchronous in (False, True):
        state = _State(0)
        torch.manual_seed(5)  # the same RNG state in both checkpoints
        saver = _checkpointer(tmp_path / str(asynchronous), asynchronous)
        started = saver.maybe_save(2, state)
        refs[asynchronous] = saver.wait() if asynchronous else started
        assert refs[asynchronous] == CheckpointRef(2, tmp_path / str(asynchronous) / "step_00000002")
        saver.close()
    sync, background = (_files(refs[flag]) for flag in (False, True))
    assert sorted(sync) == sorted(background)
    assert "tensors/shard-00001-model-00001-of-00001.safetensors" in sync and "trainer.json" in sync
    for name in sync:
        if name in ("meta.json", "manifest.json"):  # the save's wall-clock time, and that file's hash
            continue
        if name.startswith("tensors/"):
            assert _safetensors_content(background[name]) == _safetensors_content(sync[name]), name
        else:
            assert background[name] == sync[name], name
    meta = [json.loads(files["meta.json"]) for files in (sync, background)]
    assert [{k: v for k, v in m.items() if k != "time"} for m in meta] == [
        {"step": 2, "world_size": 1, "intra_op_threads": torch.get_num_threads()}] * 2
    checked, problem = verify(refs[True])
    assert problem is None and checked.verified


def test_the_checkpoint_holds_the_state_of_the_step_it_was_requested_at(tmp_path, gate):
    state = _State(1)
    saver = _checkpointer(tmp_path, asynchronous=True)
    weights = {k: v.clone() for k, v in state.model.state_dict().items()}
    moments = {k: v["exp_avg"].clone() for k, v in state.optimizer.state_dict()["state"].items()}
    rng = torch.get_rng_state().clone()
    started = saver.maybe_save(2, state)  # returns while its write waits at the gate
    assert gate.entered.wait(30)
    assert not (tmp_path / "step_00000002").exists()
    for _ in range(2):  # training goes on while the checkpoint is being written
        state.train_a_step()
    assert not torch.equal(state.model[0].weight, weights["0.weight"])
    gate.set()
    assert saver.wait() == started
    saver.close()

    fresh = _State(7)
    trainer_state = load_checkpoint(started, fresh.model, fresh.optimizer)
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    for index, value in fresh.optimizer.state_dict()["state"].items():
        assert torch.equal(value["exp_avg"], moments[index]), index
    assert trainer_state["ranks"][0]["loader"]["cursor"] == 3 and trainer_state["tokens_seen"] == 30
    assert torch.equal(trainer_state["ranks"][0]["rng"]["torch"], rng)


def test_the_next_save_waits_for_the_one_in_flight_and_pruning_keeps_the_newest(tmp_path, gate):
    state = _State(2)
    saver = _checkpointer(tmp_path, asynchronous=True, keep_last=1)
    saver.maybe_save(2, state)
    assert gate.entered.wait(30)
    second = threading.Thread(target=saver.maybe_save, args=(4, state))
    second.start()
    second.join(1.0)
    assert second.is_alive()  # blocked behind step 2's save, which the gate holds
    assert not (tmp_path / ".tmp-step_00000004").exists() and list_complete(tmp_path) == []
    gate.set()
    second.join(60)
    assert not second.is_alive()
    assert [r.step for r in list_complete(tmp_path)] == [2]  # step 4 is still in flight: 2 stays
    assert saver.wait().step == 4
    assert [r.step for r in list_complete(tmp_path)] == [4]  # keep_last = 1 after 4 completed
    saver.close()


def test_a_failed_background_write_is_raised_on_the_loop_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    state = _State(3)
    saver = _checkpointer(tmp_path, asynchronous=True, keep_last=1)
    saver.maybe_save(2, state)
    assert saver.wait().step == 2
    monkeypatch.setenv(FAIL_ENV, "4")  # step 4's write fails after its tensor files are written
    started = saver.maybe_save(4, state)
    assert started.step == 4 and not started.path.exists()
    assert saver.maybe_save(5, state) is None  # not due: training goes on, the failure waits for the next save
    with pytest.raises(OSError, match="checkpoint write of step 4 failed"):
        saver.maybe_save(6, state)
    assert (tmp_path / ".tmp-step_00000004" / "tensors").is_dir()  # the interrupted write, never renamed
    assert [r.step for r in list_complete(tmp_path)] == [2]
    ref, skipped = newest_intact(tmp_path)
    assert ref.step == 2 and skipped == []
    fresh = _State(9)
    assert load_checkpoint(ref, fresh.model, fresh.optimizer)["step"] == 2
    saver.close()


def test_a_failure_at_the_runs_end_is_raised_by_wait_and_only_logged_by_close_on_a_failing_path(tmp_path,
                                                                                                  monkeypatch):
    state = _State(4)
    monkeypatch.setenv(FAIL_ENV, "2")
    saver = _checkpointer(tmp_path, asynchronous=True)
    saver.maybe_save(2, state)
    with pytest.raises(OSError, match="step 2 failed"):
        saver.wait()
    saver.maybe_save(4, state)  # the failure was raised once; a later save runs (the fault names step 2 only)
    assert saver.wait().step == 4
    monkeypatch.setenv(FAIL_ENV, "6")
    saver.maybe_save(6, state)
    saver.close(raise_errors=False)  # a run already failing keeps its own error
    assert [r.step for r in list_complete(tmp_path)] == [4]


def test_a_non_finite_state_stops_the_run_from_the_background_save(tmp_path):
    state = _State(5)
    saver = _checkpointer(tmp_path, asynchronous=True)
    with torch.no_grad():
        state.model[0].weight[0, 0] = float("nan")
    saver.maybe_save(2, state)
    with pytest.raises(TrainingDiverged, match="refusing to save step 2"):
        saver.wait()
    assert list_complete(tmp_path) == [] and not (tmp_path / ".tmp-step_00000002").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_the_background_writer_writes_what_dcps_writer_writes(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    state = {"model": {"w": (torch.randn(3, 5, generator=gen) * 4).to(dtype), "scalar": torch.tensor(7.0).to(dtype),
                       "empty": torch.zeros(0, 4, dtype=dtype), "wide": torch.randn(2, 9, generator=gen).to(dtype)},
             "optimizer": {"state": {"w": {"step": torch.tensor(3.0)}}}}
    contents = []
    for name, writer in (("dcp", HuggingFaceStorageWriter), ("background", _UnblockingSafetensorsWriter)):
        (tmp_path / name).mkdir()
        with _quiet_single_process():
            dcp.save(state, storage_writer=writer(str(tmp_path / name), save_distributed=True), no_dist=True)
        (file,) = (tmp_path / name).glob("*.safetensors")
        contents.append((file.name, _safetensors_content(file.read_bytes())))
    assert contents[1] == contents[0]
    loaded = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
              "optimizer": {"state": {"w": {"step": torch.tensor(0.0)}}}}
    with _quiet_single_process():
        dcp.load(loaded, storage_reader=HuggingFaceStorageReader(str(tmp_path / "background")), no_dist=True)
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    assert float(loaded["optimizer"]["state"]["w"]["step"]) == 3.0
