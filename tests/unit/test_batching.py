"""Loader and batching: a global order independent of the world size, exact resume on any world, token budgets.

References are independent of moetrain.data.batching: the document lists the stream was
built from, plain loops over them, and the world-1 loader for the multi-rank splits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moetrain.config.data import DataConfig
from moetrain.config.job import JobConfig
from moetrain.data.batching import PackedBatching, TokenBudgetBatching, build_batching, documents_end
from moetrain.data.loader import DataLoader
from moetrain.data.packing import IGNORE_INDEX, PackedSequences, TokenStream
from moetrain.errors import ConfigError

BOS, EOS, PAD = 256, 257, 258


def _documents(n: int, seed: int = 0, longest: int = 40) -> list[list[int]]:
    """n documents as [BOS, bytes..., EOS], of 2 to longest + 2 tokens."""
    rng = np.random.default_rng(seed)
    return [[BOS, *rng.integers(0, 256, int(rng.integers(0, longest + 1))).tolist(), EOS] for _ in range(n)]


def _sequences(documents: list[list[int]], seq_len: int = 16) -> PackedSequences:
    stream = torch.tensor([t for d in documents for t in d], dtype=torch.int32)
    return PackedSequences(stream, seq_len, eos_id=EOS, pad_id=PAD)


def _batching(kind: str, documents: list[list[int]], seed: int = 0):
    sequences = _sequences(documents)
    return PackedBatching(sequences, 2) if kind == "packed" else TokenBudgetBatching(sequences, 24, seed)


def _equal(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "positions", "document_ids", "targets"))


# ---------------------------------------------------------------- global order


@pytest.mark.parametrize("kind", ["packed", "token_budget"])
def test_global_batch_of_every_step_is_the_same_for_1_2_and_4_ranks(kind):
    batching = _batching(kind, _documents(30))
    one = DataLoader(batching, seed=3, dp_rank=0, dp_world=1, microbatches_per_rank=4)
    splits = {world: [DataLoader(batching, seed=3, dp_rank=r, dp_world=world, microbatches_per_rank=4 // world)
                      for r in range(world)] for world in (2, 4)}
    steps = 3 * batching.n_units // (4 * batching.units_per_microbatch) + 1  # crosses several epochs
    for _ in range(steps):
        expected = one.next_microbatches()
        for world, loaders in splits.items():
            got = [mb for loader in loaders for mb in loader.next_microbatches()]
            assert len(got) == len(expected) and all(_equal(g, e) for g, e in zip(got, expected)), (world, kind)
    if kind == "token_budget":
        # The precondition of the token-budget tests: microbatches differ in length.
        lengths = {one.next_microbatches()[m].tokens.shape[1] for m in range(4) for _ in range(3)}
        assert len(lengths) > 1


def test_each_epoch_visits_every_unit_once_in_a_new_seeded_order():
    batching = PackedBatching(_sequences(_documents(30)), 1)
    n = batching.n_units
    loader = DataLoader(batching, seed=5)
    units = [loader.unit(g) for g in range(3 * n)]
    epochs = [units[e * n: (e + 1) * n] for e in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert [DataLoader(batching, seed=6).unit(g) for g in range(n)] != epochs[0]
    # A pure function of (seed, global index): a fresh loader agrees at any index, in any order.
    fresh = DataLoader(batching, seed=5)
    assert [fresh.unit(g) for g in reversed(range(3 * n))] == units[::-1]


def test_state_resumes_exactly_on_another_world_size():
    batching = _batching("token_budget", _documents(40))
    four = [DataLoader(batching, seed=1, dp_rank=r, dp_world=4) for r in range(4)]
    for _ in range(5):
        for loader in four:
            loader.next_microbatches()
    states = [json.loads(json.dumps(loader.state_dict())) for loader in four]  # plain JSON
    assert all(s == states[0] for s in states)  # the same on every rank
    expected = [[mb for loader in four for mb in loader.next_microbatches()] for _ in range(6)]
    for world in (1, 2):
        resumed = [DataLoader(batching, seed=1, dp_rank=r, dp_world=world, microbatches_per_rank=4 // world)
                   for r in range(world)]
        for loader in resumed:
            loader.load_state_dict(states[0])
        for step in expected:
            got = [mb for loader in resumed for mb in loader.next_microbatches()]
            assert all(_equal(g, e) for g, e in zip(got, step))


def test_state_from_other_data_seed_batching_or_an_old_loader_is_refused():
    documents = _documents(30)
    state = DataLoader(_batching("packed", documents), seed=7).state_dict()
    with pytest.raises(ConfigError, match="resume with the same data and data.batching settings"):
        DataLoader(_batching("packed", documents[:-3]), seed=7).load_state_dict(state)
    with pytest.raises(ConfigError, match="resume with the same data and data.batching settings"):
        DataLoader(_batching("token_budget", documents), seed=7).load_state_dict(state)
    with pytest.raises(ConfigError, match="differs from the checkpoint's seed"):
        DataLoader(_batching("packed", documents), seed=8).load_state_dict(state)
    with pytest.raises(ConfigError, match="predates the rank-independent data order"):
        DataLoader(_batching("packed", documents), seed=7).load_state_dict({"epoch": 0, "cursor_": 3})


def test_no_training_tokens_is_a_config_error():
    empty = PackedSequences(torch.empty(0, dtype=torch.int32), 8, eos_id=EOS, pad_id=PAD)
    for batching in ("packed", "token_budget"):
        with pytest.raises(ConfigError, match="no tokens to batch"):
            build_batching(empty, DataConfig(batching=batching), 4, 0)


# ---------------------------------------------------------------- token budget


def test_document_starts_of_the_in_memory_stream():
    documents = _documents(12)
    starts = _sequences(documents).document_starts
    assert starts.dtype == np.int64
    assert starts.tolist() == np.cumsum([0] + [len(d) for d in documents[:-1]]).tolist()


def test_bins_hold_whole_documents_next_fit_and_cut_only_longer_ones():
    budget = 24
    documents = _documents(60, seed=2, longest=70)
    sequences = _sequences(documents)
    layout = TokenBudgetBatching(sequences, budget, seed=4).layout
    bounds = np.cumsum([0] + [len(d) for d in documents])
    covered: list[tuple[int, int]] = []
    for b in range(len(layout)):
        pieces = layout.pieces(b)
        assert sum(n for _, n in pieces) <= budget
        for start, length in pieces:
            doc = int(np.searchsorted(bounds, start, side="right")) - 1
            assert start + length <= bounds[doc + 1]  # inside one document
            doc_length = len(documents[doc])
            if doc_length <= budget:
                assert (start, length) == (bounds[doc], doc_length)  # whole
            else:
                assert (start - bounds[doc]) % budget == 0 and length == min(budget, bounds[doc + 1] - start)
            covered.append((start, length))
        if b + 1 < len(layout):  # next fit: the next bin's first piece would not have fit
            assert sum(n for _, n in pieces) + layout.pieces(b + 1)[0][1] > budget
    covered.sort()
    assert covered[0][0] == 0 and all(a + n == c for (a, n), (c, _) in zip(covered, covered[1:]))
    assert covered[-1][0] + covered[-1][1] == bounds[-1]  # every token once, the PAD tail in none
    assert len(sequences.stream) >= bounds[-1] == documents_end(sequences.stream, PAD)  # the PAD tail is virtual


def test_token_budget_microbatch_fields_against_the_documents():
    budget = 24
    documents = _documents(25, seed=3, longest=60)
    batching = TokenBudgetBatching(_sequences(documents), budget, seed=0)
    bounds = np.cumsum([0] + [len(d) for d in documents])
    for b in range(batching.n_units):
        batch = batching.microbatch([b])
        tokens, positions, targets, document_ids = [], [], [], []
        for index, (start, length) in enumerate(batching.layout.pieces(b)):
            doc = int(np.searchsorted(bounds, start, side="right")) - 1
            text, offset = documents[doc], start - int(bounds[doc])
            for j in range(length):
                k = offset + j
                tokens.append(text[k])
                targets.append(text[k + 1] if k + 1 < len(text) else IGNORE_INDEX)
                positions.append(j)
                document_ids.append(index)
        assert batch.tokens.shape == (1, len(tokens))
        assert batch.tokens[0].tolist() == tokens and batch.targets[0].tolist() == targets
        assert batch.positions[0].tolist() == positions and batch.document_ids[0].tolist() == document_ids


def test_an_epoch_of_token_budget_microbatches_trains_every_target_once():
    documents = _documents(40, seed=5, longest=60)
    sequences = _sequences(documents)
    batching = TokenBudgetBatching(sequences, 20, seed=0)
    loader = DataLoader(batching, seed=0)
    targets = [t for _ in range(batching.n_units) for t in loader.next_microbatches()[0].targets[0].tolist()]
    expected = [t for d in documents for t in d[1:]]  # each document: its bytes and its EOS
    assert sorted(t for t in targets if t != IGNORE_INDEX) == sorted(expected)
    packed = sequences.batch(list(range(len(sequences))))
    assert packed.n_valid_targets == len(expected)


def test_token_budget_config():
    cfg = JobConfig()
    assert (cfg.data.batching, cfg.data.token_budget) == ("packed", None)
    cfg.data.batching, cfg.data.token_budget = "token_budget", cfg.model.max_seq_len + 1
    with pytest.raises(ConfigError, match=r"data.token_budget = 513 is invalid: must be in \[1, model.max_seq_len"):
        cfg.validate()
    cfg.data.token_budget = None
    batching = build_batching(_sequences(_documents(10)), cfg.validate().data, 4, 0)
    assert isinstance(batching, TokenBudgetBatching) and batching.token_budget == cfg.data.seq_len


def test_token_budget_bins_read_a_memory_mapped_stream_like_the_in_memory_one(tmp_path):
    documents = _documents(30, seed=6, longest=50)
    in_memory = _sequences(documents)
    tokens = np.array([t for d in documents for t in d], dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    mapped = PackedSequences(TokenStream([np.memmap(path, dtype=np.uint16, mode="r")], PAD), in_memory.seq_len,
                             eos_id=EOS, pad_id=PAD, document_starts=in_memory.document_starts)
    a, b = TokenBudgetBatching(in_memory, 20, seed=1), TokenBudgetBatching(mapped, 20, seed=1)
    assert a.n_units == b.n_units
    assert all(_equal(a.microbatch([u]), b.microbatch([u])) for u in range(a.n_units))
