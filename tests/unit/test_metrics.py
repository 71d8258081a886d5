"""Metrics helpers against closed forms: bits per byte, unigram entropy, JSONL records, optional TensorBoard."""

from __future__ import annotations

import json
import math
import sys

import pytest

from moetrain.data.dataset import byte_histogram, unigram_entropy_bits
from moetrain.errors import ConfigError
from moetrain.observe.metrics import MetricsWriter, bits_per_byte
from moetrain.observe.plot import read_records, series
from moetrain.train.trainer import eval_indices


def test_bits_per_byte_is_nats_over_bytes_in_bits():
    assert bits_per_byte(math.log(2) * 30, 10) == pytest.approx(3.0)
    assert math.isnan(bits_per_byte(1.0, 0))


def test_unigram_entropy_closed_forms():
    assert unigram_entropy_bits({i: 5 for i in range(256)}) == pytest.approx(8.0)
    assert unigram_entropy_bits(byte_histogram(["aab"])) == pytest.approx(-(2 / 3) * math.log2(2 / 3)
                                                                          - (1 / 3) * math.log2(1 / 3))
    assert unigram_entropy_bits(byte_histogram(["zzzz"])) == 0.0


def test_records_keep_the_last_per_step_and_tolerate_a_truncated_tail(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"kind": "event", "event": "start", "step": 0}, {"kind": "train", "step": 1, "loss": 5.0},
             {"kind": "train", "step": 2, "loss": 4.0}, {"kind": "event", "event": "resume", "step": 1},
             {"kind": "train", "step": 2, "loss": 3.5}, {"kind": "eval", "step": 2, "heldout_loss": 3.9}]
    path.write_text("\n".join(json.dumps(r) for r in lines) + '\n{"kind": "train", "st')
    records = read_records(path)
    assert series(records, "train", "loss") == ([1, 2], [5.0, 3.5])
    assert series(records, "eval", "heldout_loss") == ([2], [3.9])
    assert [r["event"] for r in records if r["kind"] == "event"] == ["start", "resume"]
    path.write_text('{"kind": "train", "step": 1, "loss": 1}\nnot json\n{"kind": "train", "step": 2, "loss": 1}\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2 is not a JSON record"):
        read_records(path)


def test_writer_only_writes_when_enabled_and_tensorboard_is_optional(tmp_path, monkeypatch):
    MetricsWriter(tmp_path / "off", enabled=False).write({"kind": "train", "step": 1})
    assert not (tmp_path / "off").exists()
    writer = MetricsWriter(tmp_path / "on", enabled=True)
    writer.write({"kind": "train", "step": 1, "loss": float("nan")})
    assert math.isnan(read_records(tmp_path / "on" / "metrics.jsonl")[0]["loss"])
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match="needs the `tensorboard` package"):
        MetricsWriter(tmp_path / "tb", enabled=True, tensorboard=True)


def test_evaluation_set_is_the_same_for_every_world_size_and_split_evenly():

    reference = [(i * 1000) // 32 for i in range(32)]  # 32 evenly spaced of 1000
    for world in (1, 2, 4, 8):
        shares = [eval_indices(1000, 32, rank, world) for rank in range(world)]
        assert sorted(i for share in shares for i in share) == reference
        assert {len(share) for share in shares} == {32 // world}
    # Fewer sequences than wanted: all of them; fewer than ranks: one each, repeating.
    assert eval_indices(5, 32, 0, 1) == [0, 1, 2, 3, 4]
    assert [eval_indices(3, 32, r, 4) for r in range(4)] == [[0], [0], [1], [2]]
