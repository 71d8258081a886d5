"""Training from prepared token shards: the same run as from the text, and bad shards stop it before any write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetrain import cli


def _losses(run_dir: Path) -> list[float]:
    """Every training loss, then every held-out loss, in order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return ([r["loss"] for r in records if r["kind"] == "train"]
            + [r["heldout_loss"] for r in records if "heldout_loss" in r])


def _prepare(corpus_dir: Path, out: Path, *extra: str) -> None:
    argv = ["data", "prepare", "--input", str(corpus_dir), "--out", str(out), "--glob", "*.py",
            "--heldout-fraction", "0.2", "--shard-mb", "0.02", "--workers", "2", "--quiet", *extra]
    assert cli.main(argv) == 0


@pytest.mark.parametrize("batching", ["packed", "token_budget"])
def test_training_from_shards_reproduces_training_from_text(job_args, corpus_dir, tmp_path, batching):
    shards = tmp_path / "shards"
    _prepare(corpus_dir, shards)
    common = {"train__steps": 3, "train__eval_every": 3, "data__batching": batching}
    assert cli.main(["train", *job_args(tmp_path / "text", **common)]) == 0
    assert cli.main(["train", *job_args(tmp_path / "tokens", data__source="tokens", data__path=shards,
                                        **common)]) == 0
    text = _losses(tmp_path / "text")
    assert len(text) >= 4 and text == _losses(tmp_path / "tokens")


def test_a_damaged_shard_stops_training_before_anything_is_written(job_args, corpus_dir, tmp_path, capsys):
    """A truncated shard is refused at start; a same-size change, which only the sha256 sees, when the
    shard is first read (moetrain.data.shards: start-up does not hash the corpus): before any step."""
    shards = tmp_path / "shards"
    _prepare(corpus_dir, shards)
    tokens = shards / "train" / "shard_00000.tokens.npy"
    intact = tokens.read_bytes()
    tokens.write_bytes(intact[:-3])
    capsys.readouterr()
    run_dir = tmp_path / "run"
    assert cli.main(["train", *job_args(run_dir, data__source="tokens", data__path=shards)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and str(tokens) in lines[0] and "truncated" in lines[0], lines
    assert not run_dir.exists()
    data = bytearray(intact)
    data[-2] ^= 0x04
    tokens.write_bytes(bytes(data))
    assert cli.main(["train", *job_args(run_dir, data__source="tokens", data__path=shards)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and str(tokens) in errors[0] and "sha256" in errors[0], errors
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if r["kind"] == "train"]  # no step ran on the damaged tokens
    assert not list((run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").exists() else True
