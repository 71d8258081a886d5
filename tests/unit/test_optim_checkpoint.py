"""DCP checkpoints in one process: exact round trip, atomic directories, pruning, poison refusal."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from moetrain.checkpoint.layout import CheckpointRef, latest_complete, list_complete, remove_partial
from moetrain.checkpoint.manifest import newest_intact
from moetrain.checkpoint.state import capture_rng_state, restore_rng_state
from moetrain.checkpoint.storage import load_checkpoint, load_model_weights, save_checkpoint, saved_intra_op_threads
from moetrain.errors import PoisonedStateError


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_round_trip_continues_bitwise_identically(tmp_path):
    model, opt = _model_and_optimizer(0)
    _train(model, opt, 3, seed=1)
    ref = save_checkpoint(tmp_path, 3, model, opt, {"note": "x"}, {"loader": {"cursor": 7}}, keep_last=2)
    expected = _train(model, opt, 4, seed=2)

    other, other_opt = _model_and_optimizer(123)  # different weights, fresh optimizer
    trainer_state = load_checkpoint(ref, other, other_opt)
    assert trainer_state["step"] == 3 and trainer_state["note"] == "x" and trainer_state["world_size"] == 1
    assert trainer_state["ranks"] == [{"loader": {"cursor": 7}}]
    assert _train(other, other_opt, 4, seed=2) == expected
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_model_only_load_and_rng_restore(tmp_path):
    model, opt = _model_and_optimizer(0)
    _train(model, opt, 1, seed=1)
    torch.manual_seed(99)
    rng = capture_rng_state()
    ref = save_checkpoint(tmp_path, 1, model, opt, {}, {"rng": rng}, keep_last=1)
    draws = torch.rand(4)
    fresh, _ = _model_and_optimizer(5)
    state = load_model_weights(ref, fresh)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    restore_rng_state(state["ranks"][0]["rng"])
    assert torch.equal(torch.rand(4), draws)


def test_keep_last_and_partial_directories_are_never_picked(tmp_path):
    model, opt = _model_and_optimizer(0)
    _train(model, opt, 1, seed=1)
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, model, opt, {}, {}, keep_last=2)
    assert [r.step for r in list_complete(tmp_path)] == [4, 6]
    # An interrupted write of a later step (temp dir, even with DCP metadata) is ignored ...
    partial = tmp_path / ".tmp-step_00000008"
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"half")
    # ... and a final-looking directory without a manifest is skipped as damaged, naming the file.
    (tmp_path / "step_00000010").mkdir()
    ref, skipped = newest_intact(tmp_path)
    assert ref == CheckpointRef(6, tmp_path / "step_00000006", verified=True)
    assert skipped == [f"{tmp_path / 'step_00000010' / 'manifest.json'} is missing"]
    assert remove_partial(tmp_path) == [partial] and not partial.exists()
    assert latest_complete(tmp_path / "missing") is None


def test_poisoned_state_is_refused_and_nothing_is_written(tmp_path):
    model, opt = _model_and_optimizer(0)
    _train(model, opt, 1, seed=1)
    save_checkpoint(tmp_path, 1, model, opt, {}, {}, keep_last=3)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(PoisonedStateError, match="refusing to save step 2"):
        save_checkpoint(tmp_path, 2, model, opt, {}, {}, keep_last=3)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
    assert latest_complete(tmp_path).step == 1


def test_restoring_rng_state_restores_python_random():
    import random

    random.seed(3)
    state = capture_rng_state()
    first = [random.random() for _ in range(3)]
    restore_rng_state(state)
    assert [random.random() for _ in range(3)] == first


def test_the_thread_count_a_checkpoint_was_trained_with_is_recorded(tmp_path):
    model, opt = _model_and_optimizer(0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        ref = save_checkpoint(tmp_path, 1, model, opt, {}, {}, keep_last=2)
        assert saved_intra_op_threads(ref) == 3
        torch.set_num_threads(1)
        assert saved_intra_op_threads(save_checkpoint(tmp_path, 2, model, opt, {}, {}, keep_last=2)) == 1
    finally:
        torch.set_num_threads(before)
    # A checkpoint written before the count was recorded: nothing to follow.
    meta = ref.path / "meta.json"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "intra_op_threads"}))
    assert saved_intra_op_threads(ref) is None
