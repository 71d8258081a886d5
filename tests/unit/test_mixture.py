"""data.mixture: weighted sources of prepared shards, in a world-size-independent order with exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from chat_fixtures import TEMPLATES, tokenizer_dir
from moetrain.config.data import DataConfig
from moetrain.config.job import JobConfig
from moetrain.data.batching import MIXTURE_BLOCK, MixtureBatching, build_batching
from moetrain.data.dataset import load_training_data
from moetrain.data.loader import DataLoader
from moetrain.data.prepare.command import PrepareArgs, prepare
from moetrain.errors import ConfigError

# Each source writes only its own letter, so a batch's tokens tell which source they came from.
SOURCES = {"a": (0.5, 40), "b": (0.3, 7), "c": (0.2, 90)}  # letter: (weight, documents)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    for letter, (_, n_docs) in SOURCES.items():
        source = root / f"{letter}.jsonl"
        rng = np.random.default_rng(ord(letter))
        source.write_text("".join(json.dumps({"text": letter * int(rng.integers(5, 60))}) + "\n"
                                  for _ in range(n_docs)))
        prepare(PrepareArgs(input=[str(source)], out=str(root / letter), quiet=True, shard_mb=0.0005,
                            heldout_fraction=0.1))
    return root


def job(root, **data) -> JobConfig:
    cfg = JobConfig()
    data = {"seq_len": 16, **data}
    cfg.data = DataConfig(source="tokens", mixture=[f"{root / k}={w}" for k, (w, _) in SOURCES.items()],
                          heldout_fraction=0.1, **data)
    return cfg


def _letters(batch) -> dict[str, int]:
    """Sequences per source in a packed microbatch, by the letter its tokens spell."""
    counts = dict.fromkeys(SOURCES, 0)
    for row in batch.tokens:
        letters = {chr(t) for t in row.tolist() if t < 256}
        assert len(letters) == 1, letters  # a sequence never mixes sources
        counts[letters.pop()] += 1
    return counts


@pytest.mark.parametrize("batching", ["packed", "token_budget"])
def test_realised_shares_over_a_long_run_are_the_weights(prepared, batching):
    cfg = job(prepared, batching=batching, token_budget=64)  # every document (<= 61 tokens) whole in a bin
    data = load_training_data(cfg)
    mixture = build_batching(data.train, cfg.data, 8, seed=3)
    assert isinstance(mixture, MixtureBatching)
    loader = DataLoader(mixture, seed=3, microbatches_per_rank=1)
    per_step = loader.units_per_step
    steps = 2 * MIXTURE_BLOCK // per_step + 37  # two whole blocks and a part of the third
    counts = dict.fromkeys(SOURCES, 0)
    for _ in range(steps):
        for batch in loader.next_microbatches():
            if batching == "packed":
                for k, v in _letters(batch).items():
                    counts[k] += v
            else:
                letters = {chr(t) for t in batch.tokens[0].tolist() if t < 256}
                assert len(letters) == 1
                counts[letters.pop()] += 1
    total = sum(counts.values())
    assert total == steps * per_step
    for letter, (weight, _) in SOURCES.items():
        assert abs(counts[letter] / total - weight) < 0.01, (letter, counts[letter] / total)
    # every unit of a source is read once per source epoch: use counts differ by at most one
    uses = {s: np.zeros(b.n_units, dtype=np.int64) for s, b in enumerate(mixture.sources)}
    for g in range(total):
        s, u = mixture.source_unit(g)
        uses[s][u] += 1
    assert all(int(u.max() - u.min()) <= 1 for u in uses.values())


def test_resume_on_another_world_size_reads_the_same_batches(prepared):
    cfg = job(prepared)
    data = load_training_data(cfg)

    def loaders(world: int, micro: int) -> list[DataLoader]:
        return [DataLoader(build_batching(data.train, cfg.data, 2, seed=5), seed=5, dp_rank=r, dp_world=world,
                           microbatches_per_rank=micro) for r in range(world)]

    def step(ranks: list[DataLoader]) -> torch.Tensor:
        return torch.cat([b.tokens for loader in ranks for b in loader.next_microbatches()])

    four = loaders(4, 2)
    for _ in range(5):
        step(four)
    state = four[0].state_dict()
    want = [step(four) for _ in range(3)]
    for world, micro in ((2, 4), (1, 8), (8, 1)):
        resumed = loaders(world, micro)
        for loader in resumed:
            loader.load_state_dict(state)
        got = [step(resumed) for _ in range(3)]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (world, micro)
    other = DataLoader(build_batching(load_training_data(job(prepared, seq_len=32)).train, cfg.data, 2, seed=5),
                       seed=5)
    with pytest.raises(ConfigError, match="resume with the same data"):
        other.load_state_dict(state)


def test_heldout_of_a_mixture_is_every_source_and_bad_entries_are_refused(prepared, tmp_path):
    data = load_training_data(job(prepared))
    assert data.n_heldout_documents == sum(int(json.loads((prepared / k / "manifest.json").read_text())
                                               ["heldout_documents"]) for k in SOURCES)
    for entry in (f"{prepared / 'a'}", f"{prepared / 'a'}=0", f"{prepared / 'a'}=x"):
        cfg = job(prepared)
        cfg.data.mixture = [entry]
        with pytest.raises(ConfigError, match="data.mixture entry .* is invalid"):
            load_training_data(cfg)
    cfg = job(prepared)
    cfg.data.path = str(prepared / "a")
    with pytest.raises(ConfigError, match="data.path = .* is invalid: data.mixture names the directories"):
        cfg.data.validate()
    directory = tokenizer_dir(tmp_path / "tok", TEMPLATES["qwen_chatml"])
    cfg = job(prepared)
    cfg.data.tokenizer = str(directory)
    cfg.model.vocab_size = 512
    with pytest.raises(ConfigError, match="was prepared with tokenizer"):
        load_training_data(cfg)
