"""NaN/inf loss: `skip` drops that update and counts it; `stop` ends with one line and writes no checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain import cli
from moetrain.checkpoint.layout import latest_complete, list_complete
from moetrain.checkpoint.storage import load_checkpoint
from moetrain.config.job import parse_job_args
from moetrain.train import loss as loss_module
from moetrain.train import trainer as trainer_module
from moetrain.train.build import build_model
from moetrain.train.optim import build_optimizer


@pytest.fixture
def poison_step_3(monkeypatch):
    """Make the first microbatch loss of step 3 NaN (grad_accum = 2: calls 5 and 6 belong to step 3)."""
    real = loss_module.token_loss_sum
    calls = {"n": 0}

    def token_loss_sum(logits, targets, ignore_index=-100):
        calls["n"] += 1
        loss_sum, n_valid = real(logits, targets, ignore_index)
        return (loss_sum * float("nan") if calls["n"] == 5 else loss_sum), n_valid

    # Patched where the trainer looks the name up (it imports the function at module top).
    monkeypatch.setattr(trainer_module, "token_loss_sum", token_loss_sum)


def test_skip_policy_drops_the_update_and_counts_it(job_args, tmp_path, poison_step_3):
    run_dir = tmp_path / "skip"
    argv = job_args(run_dir, train__steps=4, checkpoint__every=2, train__eval_every=0,
                    data__heldout_fraction=0, train__nan_policy="skip")
    assert cli.main(["train", *argv]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if r.get("event") == "skipped_step"]
    assert [(r["step"], r["skipped_steps"]) for r in skipped] == [(3, 1)]
    final = records[-1]
    assert final["kind"] == "final" and final["skipped_steps"] == 1
    # Four steps ran but the optimizer stepped three times: AdamW's own step counter says so.
    cfg = parse_job_args(argv)
    model = build_model(cfg.model, seed=1)
    optimizer = build_optimizer(model, cfg.train)
    state = load_checkpoint(latest_complete(run_dir / "checkpoints"), model, optimizer)
    assert state["step"] == 4 and state["skipped_steps"] == 1
    assert {float(s["step"]) for s in optimizer.state.values()} == {3.0}
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_stop_policy_ends_with_one_line_and_keeps_the_last_good_checkpoint(job_args, tmp_path, poison_step_3,
                                                                           capsys):
    run_dir = tmp_path / "stop"
    argv = job_args(run_dir, train__steps=4, checkpoint__every=2, train__eval_every=0,
                    data__heldout_fraction=0, train__nan_policy="stop")
    assert cli.main(["train", *argv]) == 1
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("moetrain: error:")]
    assert len(err_lines) == 1
    assert "step 3: loss nan" in err_lines[0] and "newest complete checkpoint: step 2" in err_lines[0]
    assert [r.step for r in list_complete(run_dir / "checkpoints")] == [2]
    assert not any(p.name.startswith(".tmp-") for p in (run_dir / "checkpoints").iterdir())


def _poison_steps(monkeypatch, steps: set[int], grad_accum: int = 2) -> None:
    """Make the first microbatch loss of each step in `steps` NaN."""
    real = loss_module.token_loss_sum
    calls = {"n": 0}

    def token_loss_sum(logits, targets, ignore_index=-100):
        calls["n"] += 1
        loss_sum, n_valid = real(logits, targets, ignore_index)
        step, microbatch = divmod(calls["n"] - 1, grad_accum)
        return (loss_sum * float("nan") if step + 1 in steps and microbatch == 0 else loss_sum), n_valid

    monkeypatch.setattr(trainer_module, "token_loss_sum", token_loss_sum)


def test_skip_policy_gives_up_after_max_consecutive_skips(job_args, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "endless"
    _poison_steps(monkeypatch, {3, 4, 5, 6})
    argv = job_args(run_dir, train__steps=6, checkpoint__every=2, train__eval_every=0, data__heldout_fraction=0,
                    train__nan_policy="skip", train__max_consecutive_skips=2)
    assert cli.main(["train", *argv]) == 1
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("moetrain: error:")]
    assert len(err_lines) == 1, err_lines
    assert ("step 4: loss nan" in err_lines[0] and "2 non-finite steps in a row, giving up" in err_lines[0]
            and "train.max_consecutive_skips = 2" in err_lines[0] and "newest complete checkpoint: step 2"
            in err_lines[0]), err_lines[0]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("event") == "skipped_step"] == [3]
    assert [r.step for r in list_complete(run_dir / "checkpoints")] == [2]


def test_skips_that_are_not_consecutive_do_not_count_towards_the_cap(job_args, tmp_path, monkeypatch):
    run_dir = tmp_path / "intermittent"
    _poison_steps(monkeypatch, {2, 4, 6})
    argv = job_args(run_dir, train__steps=6, checkpoint__every=3, train__eval_every=0, data__heldout_fraction=0,
                    train__nan_policy="skip", train__max_consecutive_skips=2)
    assert cli.main(["train", *argv]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("event") == "skipped_step"] == [2, 4, 6]
    assert records[-1]["kind"] == "final" and records[-1]["skipped_steps"] == 3
