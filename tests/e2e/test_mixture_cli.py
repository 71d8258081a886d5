"""data.mixture as a user types it: `train --data.source tokens --data.mixture A=0.7 B=0.3`, and a TOML
holding only the mixture; the realised shares of the run's own loader; resume on another world size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_job_args, train_records
from moetrain import cli
from moetrain.config.job import from_dict
from moetrain.data.batching import build_batching
from moetrain.data.dataset import load_training_data
from moetrain.data.loader import DataLoader
from moetrain.testing import run_on_ranks

WEIGHTS = {"a": 0.7, "b": 0.3}  # each source writes only its own letter: a token tells its source


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixture_cli")
    for letter in WEIGHTS:
        rng = np.random.default_rng(ord(letter))
        text = root / f"{letter}.jsonl"
        text.write_text("".join(json.dumps({"text": letter * int(rng.integers(8, 40))}) + "\n" for _ in range(60)))
        assert cli.main(["data", "prepare", "--input", str(text), "--out", str(root / letter), "--quiet"]) == 0
    return root


def _mixture_job(root: Path, run_dir: Path, **overrides: object) -> list[str]:
    argv = tiny_job_args(root, run_dir, data__source="tokens", data__heldout_fraction=0.05, data__seq_len=16,
                         model__max_seq_len=16, train__steps=4, checkpoint__every=2, train__eval_every=0,
                         **overrides)
    at = argv.index("--data.path")
    del argv[at: at + 2]  # the mixture names the directories
    return [*argv, "--data.mixture", *(f"{root / k}={w}" for k, w in WEIGHTS.items())]


def _train_on_ranks(argv: list[str]) -> int:
    return cli.main(["train", *argv])


def test_a_mixture_trains_from_the_command_line_and_resumes_on_two_ranks(sources, tmp_path):
    one = tmp_path / "one"
    assert cli.main(["train", *_mixture_job(sources, one, train__grad_accum=2)]) == 0
    # the run's own loader, from the config it recorded: every unit it read, by its source's letter
    cfg = from_dict(json.loads((one / "config.json").read_text()), "config.json").validate()
    data = load_training_data(cfg)
    loader = DataLoader(build_batching(data.train, cfg.data, cfg.train.microbatch_size, cfg.train.seed),
                        seed=cfg.train.seed)
    letters = {"a": 0, "b": 0}
    for _ in range(500):
        for row in torch.cat([b.tokens for b in loader.next_microbatches()]):
            letters[chr(min(t for t in row.tolist()))] += 1
    share = letters["a"] / sum(letters.values())
    assert abs(share - WEIGHTS["a"]) < 0.03, letters

    # resume the 1-process run's step-2 checkpoint on 2 ranks (grad_accum 1: the same global batch)
    two = tmp_path / "two"
    (two / "checkpoints").mkdir(parents=True)
    (one / "checkpoints" / "step_00000002").rename(two / "checkpoints" / "step_00000002")
    argv = _mixture_job(sources, two, train__grad_accum=1, checkpoint__resume=True)
    assert run_on_ranks(_train_on_ranks, 2, argv) == [0, 0]
    expected, resumed = train_records(one), train_records(two)
    for step in (3, 4):
        assert resumed[step]["valid_tokens"] == expected[step]["valid_tokens"]
        assert resumed[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5)


def test_a_toml_with_only_a_mixture_is_a_job_and_bad_weights_are_one_line(sources, tmp_path, capsys):
    toml = tmp_path / "mix.toml"
    entries = ", ".join(json.dumps(f"{sources / k}={w}") for k, w in WEIGHTS.items())
    toml.write_text(f'[data]\nsource = "tokens"\nmixture = [{entries}]\n')
    assert cli.main(["estimate", "--config", str(toml)]) == 0
    capsys.readouterr()
    bad = ((("1e308", "1e308"), "overflow their sum"), (("0.7", "x"), "is invalid: write PATH=WEIGHT"))
    for weights, answer in bad:
        argv = ["estimate", "--config", str(toml), "--data.mixture",
                *(f"{sources / k}={w}" for k, w in zip(WEIGHTS, weights))]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and answer in err[0], err
    argv = ["estimate", "--config", str(toml), "--data.path", str(sources / "a")]
    assert cli.main(argv) == 2
    assert "data.mixture names the directories" in capsys.readouterr().err
