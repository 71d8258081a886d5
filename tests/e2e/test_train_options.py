"""Training options that must not change the numbers: activation checkpointing; aux-free balancing runs."""

from __future__ import annotations

import pytest

from moetrain import cli


def test_activation_checkpointing_gives_the_same_losses(job_args, read_train_records, tmp_path):
    common = {"train__steps": 3, "train__eval_every": 0, "checkpoint__enabled": False, "data__heldout_fraction": 0}
    assert cli.main(["train", *job_args(tmp_path / "plain", **common)]) == 0
    assert cli.main(["train", *job_args(tmp_path / "ac", train__activation_checkpointing=True, **common)]) == 0
    plain, ac = read_train_records(tmp_path / "plain"), read_train_records(tmp_path / "ac")
    for step in (1, 2, 3):
        assert ac[step]["loss"] == pytest.approx(plain[step]["loss"], rel=1e-6, abs=0)
        assert ac[step]["grad_norm"] == pytest.approx(plain[step]["grad_norm"], rel=1e-5, abs=0)


def test_aux_free_balancing_trains_and_logs_expert_load(job_args, read_train_records, tmp_path):
    argv = job_args(tmp_path / "aux_free", train__steps=2, train__eval_every=0, checkpoint__enabled=False,
                    data__heldout_fraction=0, model__moe__load_balance="aux_free")
    assert cli.main(["train", *argv]) == 0
    records = read_train_records(tmp_path / "aux_free")
    assert records[2]["aux_loss"] == 0.0  # no aux loss term in the objective
    assert records[2]["expert_load_max_over_mean"] >= 1.0
