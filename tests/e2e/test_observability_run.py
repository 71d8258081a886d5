"""Observability of a real (tiny) run: memory and expert health in the records, the profiler window, W&B offline."""

from __future__ import annotations

import json
import struct

import pytest

from moetrain import cli
from moetrain.observe.tracking import flatten_record


def test_records_carry_memory_and_expert_health_and_the_profiler_writes_a_trace(job_args, read_train_records,
                                                                                 tmp_path):
    run_dir = tmp_path / "run"
    argv = job_args(run_dir, train__steps=4, checkpoint__enabled=False, train__eval_every=0,
                    model__moe__load_balance="aux_free", profile__steps="2-3")
    assert cli.main(["train", *argv]) == 0
    records = read_train_records(run_dir)
    for record in records.values():
        assert record["peak_rss_bytes_per_rank"][0] >= record["rss_bytes_per_rank"][0] > 10 * 2**20
        assert len(record["expert_load_cv_per_layer"]) == 1  # one MoE layer of 4 experts
        load_total = 2 * 2 * 32 * 2  # microbatch 2 x accum 2 x 32 tokens x top-2
        assert record["expert_load_min_per_layer"][0] * 4 <= load_total <= record["expert_load_max_per_layer"][0] * 4
    # aux-free bias: +-bias_update_rate (1e-3) per expert per step, so the range is at most 2e-3 per step.
    assert 0 < records[4]["expert_bias_range"] <= 4 * 2e-3 + 1e-9
    trace_path = run_dir / "profile" / "rank0_steps2-3.json"
    events = json.loads(trace_path.read_text())["traceEvents"]
    labels = {event.get("name") for event in events}
    assert {"step 2", "step 3"} <= labels and "step 1" not in labels and "step 4" not in labels
    assert {"attention", "router", "experts", "optimizer"} <= labels  # moetrain's own ranges
    assert any(event.get("name", "").startswith("aten::") for event in events)  # the ops themselves
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["rank0_steps2-3.json"]


@pytest.mark.parametrize("bad", ["5-3", "0-2", "a-b", "3-"])
def test_a_bad_profile_window_is_one_line_and_writes_nothing(job_args, tmp_path, capsys, bad):
    assert cli.main(["train", *job_args(tmp_path / "run", profile__steps=bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moetrain: error: profile.steps = ")
    assert not (tmp_path / "run").exists()


def _wandb_records(path):
    """The protobuf records of a .wandb file: a 7-byte header, then LevelDB-log chunks in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, records = path.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, chunk_type = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if chunk_type in (1, 2) else pending + chunk  # full / first start a record
        if chunk_type in (1, 4):  # full / last end it
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_run_holds_the_metrics_and_the_config(job_args, read_train_records, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    argv = job_args(run_dir, train__steps=3, checkpoint__every=3, train__eval_every=0,
                    logging__wandb=True, logging__wandb_project="moetrain-test")
    assert cli.main(["train", *argv]) == 0
    offline = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1
    records = _wandb_records(offline[0])
    history: dict[int, dict[str, float]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[items["_step"]] = items
    for step, record in read_train_records(run_dir).items():
        for key, value in flatten_record(record).items():
            assert history[step][key] == pytest.approx(value, rel=1e-12), key
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["model"]["dim"] == 32 and config["logging"]["wandb_project"] == "moetrain-test"
    assert run.project == "moetrain-test"
    # a restarted job resumes its own W&B run (the id kept in the run directory), not a new one
    stored = (run_dir / "wandb_run_id").read_text()
    assert offline[0].name == f"run-{stored}.wandb"
    resumed = job_args(run_dir, train__steps=4, checkpoint__every=3, train__eval_every=0, checkpoint__resume=True,
                       checkpoint__allow_schedule_change=True,
                       logging__wandb=True, logging__wandb_project="moetrain-test")
    assert cli.main(["train", *resumed]) == 0
    assert {p.name for p in (run_dir / "wandb").glob("offline-run-*/run-*.wandb")} == {f"run-{stored}.wandb"}


def test_flatten_record_keeps_numbers_and_indexes_lists():
    record = {"kind": "train", "step": 4, "loss": 1.5, "skipped": False, "sample": "text", "n": 3,
              "per_rank": [1.0, 2.0], "per_layer": [[1, 2]]}
    assert flatten_record(record) == {"train/loss": 1.5, "train/n": 3, "train/per_rank/0": 1.0,
                                      "train/per_rank/1": 2.0, "train/per_layer/0/0": 1, "train/per_layer/0/1": 2}
