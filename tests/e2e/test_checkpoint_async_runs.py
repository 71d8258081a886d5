"""Training runs with `checkpoint.async_save`: resume is exact, a kill during a background write loses nothing complete.

References: the same job trained without interruption (and with synchronous saves), step by step;
what is on disk after a SIGKILL (`list_complete`, `newest_intact`).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch.distributed.checkpoint as dcp
from test_train_disk_full import _fill_disk, _one_error_line, _records_parse
from test_train_kill import train_paused_at_step_4_then_sigkill
from test_train_nan import poison_step_3  # noqa: F401  (a fixture, used by name below)
from test_train_torchrun import TORCHRUN, _torchrun

from moetrain import cli
from moetrain.checkpoint.layout import list_complete
from moetrain.checkpoint.manifest import newest_intact
from moetrain.runtime.faults import FAIL_ENV
from moetrain.train import run

KEYS = ("loss", "grad_norm", "lr", "aux_loss", "valid_tokens")


def _same_steps(resumed: dict[int, dict], expected: dict[int, dict], steps: list[int]) -> None:
    assert sorted(resumed) == sorted(expected) == steps
    for step in steps:
        for key in KEYS:
            assert resumed[step][key] == expected[step][key], (step, key)
    assert len({expected[step]["loss"] for step in steps}) == len(steps)  # the losses move: not constants


def test_a_run_resumed_from_an_async_checkpoint_matches_an_uninterrupted_synchronous_run(job_args,
                                                                                       read_train_records, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run.main(job_args(straight)) == 0
    assert run.main(job_args(split, train__stop_at_step=3, checkpoint__async_save=True)) == 0
    # The stop waited for the background write: the checkpoint is complete and intact when the run returns.
    ref, skipped = newest_intact(split / "checkpoints")
    assert ref.step == 3 and skipped == []
    assert not list((split / "checkpoints").glob(".tmp-*"))
    assert run.main(job_args(split, checkpoint__resume=True, checkpoint__async_save=True)) == 0
    _same_steps(read_train_records(split), read_train_records(straight), [1, 2, 3, 4, 5, 6])
    assert [r.step for r in list_complete(split / "checkpoints")] == [3, 6]  # the last step's save completed


def test_sigkill_during_a_background_write_keeps_the_previous_checkpoint(job_args, read_train_records, tmp_path):
    run_dir = tmp_path / "run"
    # keep_last = 1: step 2's checkpoint may only be pruned once step 4's is complete.
    args = job_args(run_dir, checkpoint__every=2, checkpoint__keep_last=1, train__eval_every=0,
                    checkpoint__async_save=True)
    paused = run_dir / "checkpoints" / ".tmp-step_00000004" / "PAUSED"
    # Rank 0's background write of step 4 stops before its manifest; training goes on while step 4 is
    # being written, until step 6's save waits for it.
    returncode = train_paused_at_step_4_then_sigkill(
        args, lambda: paused.exists() and 6 in read_train_records(run_dir), "step 6 with step 4's write paused")
    assert returncode == -signal.SIGKILL
    assert [r.step for r in list_complete(run_dir / "checkpoints")] == [2]
    ref, skipped = newest_intact(run_dir / "checkpoints")
    assert ref.step == 2 and skipped == []
    killed = read_train_records(run_dir)
    assert sorted(killed) == [1, 2, 3, 4, 5, 6]

    assert run.main(job_args(run_dir, checkpoint__every=2, checkpoint__keep_last=1, train__eval_every=0,
                             checkpoint__async_save=True, checkpoint__resume=True)) == 0
    assert not paused.parent.exists()
    assert [r.step for r in list_complete(run_dir / "checkpoints")] == [2, 6]  # 2: resumed from, kept by this run
    _same_steps(read_train_records(run_dir), killed, [1, 2, 3, 4, 5, 6])  # 3..6 recomputed from step 2


def test_a_failed_background_write_fails_the_run_with_its_error(job_args, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAIL_ENV, "3")
    with pytest.raises(OSError, match="checkpoint write of step 3 failed"):
        run.main(job_args(run_dir, checkpoint__async_save=True, train__eval_every=0))
    assert list_complete(run_dir / "checkpoints") == []


def test_a_full_disk_in_a_background_write_is_the_one_line_of_a_synchronous_one(job_args, tmp_path, monkeypatch,
                                                                                capsys):
    run_dir = tmp_path / "run"
    _fill_disk(monkeypatch, lambda p: "checkpoints" in p.parts)
    argv = job_args(run_dir, train__steps=4, checkpoint__every=2, train__eval_every=0, checkpoint__async_save=True)
    assert cli.main(["train", *argv]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "no space left on device writing the checkpoint" in line, line
    assert str(run_dir / "checkpoints") in line and "No space left on device" in line, line
    assert list_complete(run_dir / "checkpoints") == []
    # Step 2's write failed in the background while steps 3 and 4 trained; step 4's save raised it.
    assert max(r["step"] for r in _records_parse(run_dir)) == 4


@pytest.mark.usefixtures("poison_step_3")
def test_a_stop_on_a_nan_names_the_checkpoint_that_was_still_being_written(job_args, tmp_path, monkeypatch,
                                                                           capsys):
    real_save = dcp.save

    def slow_save(*args, **kwargs):  # step 2's background write is still in flight at step 3
        if threading.current_thread() is not threading.main_thread():
            time.sleep(2.0)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", slow_save)
    run_dir = tmp_path / "stop"
    argv = job_args(run_dir, train__steps=4, checkpoint__every=2, train__eval_every=0, data__heldout_fraction=0,
                    train__nan_policy="stop", checkpoint__async_save=True)
    assert cli.main(["train", *argv]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "step 3: loss nan" in line and "newest complete checkpoint: step 2" in line, line
    assert [r.step for r in list_complete(run_dir / "checkpoints")] == [2]
    assert not any(p.name.startswith(".tmp-") for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH next to this interpreter")
def test_two_ranks_resume_from_an_async_checkpoint_with_the_losses_of_an_uninterrupted_run(job_args,
                                                                                          read_train_records,
                                                                                          tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = {"train__steps": 4, "checkpoint__every": 2, "train__eval_every": 0}
    done = _torchrun(2, job_args(straight, **common))
    assert done.returncode == 0, done.stderr[-3000:]
    first = _torchrun(2, job_args(split, **common, train__stop_at_step=2, checkpoint__async_save=True))
    assert first.returncode == 0, first.stderr[-3000:]
    assert [r.step for r in list_complete(split / "checkpoints")] == [2]
    resumed = _torchrun(2, job_args(split, **common, checkpoint__async_save=True, checkpoint__resume=True))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "written in the background" in resumed.stderr
    _same_steps(read_train_records(split), read_train_records(straight), [1, 2, 3, 4])
    assert [r.step for r in list_complete(split / "checkpoints")] == [2, 4]
