"""`train.compile` end to end: the trainer's steps, evaluations and sample with compiled blocks give
the eager run's losses, and compile each block kind once (no recompilation between steps, for the
global-balance routing pass, evaluation or sampling)."""

from __future__ import annotations

import json

import pytest
import torch._dynamo as dynamo
from torch._dynamo.utils import counters

from moetrain import cli
from moetrain.parallel import parallelize


def heldout_records(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["heldout_loss"] for r in records if "heldout_loss" in r}


@pytest.mark.parametrize("scope", ["microbatch", "global_batch"])
def test_compiled_training_matches_eager_and_compiles_once(job_args, read_train_records, tmp_path, monkeypatch,
                                                           scope):
    # Dynamo and AOT autograd trace exactly as with inductor; only the C++ kernel build is skipped
    # (tests/unit/test_compile_and_checkpointing.py runs inductor itself).
    monkeypatch.setattr(parallelize, "COMPILE_BACKEND", "aot_eager")
    common = {"train__steps": 4, "train__eval_every": 2, "checkpoint__enabled": False, "train__sample_tokens": 4,
              "model__moe__aux_loss_scope": scope}
    assert cli.main(["train", *job_args(tmp_path / "eager", **common)]) == 0
    dynamo.reset()
    counters.clear()
    assert cli.main(["train", *job_args(tmp_path / "compiled", train__compile=True, **common)]) == 0
    assert counters["stats"]["unique_graphs"] == 2  # the dense block and the MoE block, each once
    assert not counters["graph_break"]
    eager, compiled = read_train_records(tmp_path / "eager"), read_train_records(tmp_path / "compiled")
    assert sorted(compiled) == sorted(eager) == [1, 2, 3, 4]
    for step in eager:
        assert compiled[step]["loss"] == pytest.approx(eager[step]["loss"], rel=1e-5, abs=0)
    heldout_e, heldout_c = heldout_records(tmp_path / "eager"), heldout_records(tmp_path / "compiled")
    assert heldout_e and heldout_c.keys() == heldout_e.keys()
    for step, loss in heldout_e.items():
        assert heldout_c[step] == pytest.approx(loss, rel=1e-5, abs=0)
