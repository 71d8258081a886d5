"""Training options that must not change the numbers: activation checkpointing, how often the held-out
evaluation runs; aux-free balancing runs."""

from __future__ import annotations

import json

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


def test_evaluation_between_steps_changes_no_training_number(job_args, tmp_path):
    # The default job's eval_every trades held-out curve points for time on the premise that an evaluation
    # touches no training state (the loader's position, the weights, the optimizer).
    common = {"train__steps": 3, "checkpoint__enabled": False}
    assert cli.main(["train", *job_args(tmp_path / "none", train__eval_every=0, **common)]) == 0
    assert cli.main(["train", *job_args(tmp_path / "each", train__eval_every=1, **common)]) == 0
    runs = {}
    for name in ("none", "each"):
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = {"evals": sum(r["kind"] == "eval" for r in records),
                      "train": [(r["loss"], r["grad_norm"]) for r in records if r["kind"] == "train"],
                      "final": next(r["heldout_bpb"] for r in records if r["kind"] == "final")}
    assert (runs["none"]["evals"], runs["each"]["evals"]) == (1, 3)
    assert runs["each"]["train"] == runs["none"]["train"]  # bit for bit
    assert runs["each"]["final"] == runs["none"]["final"]
