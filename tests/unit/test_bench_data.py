"""`moetrain bench data`'s synthetic corpus: valid shards the trainer's checks accept, with the asked size."""

from __future__ import annotations

import numpy as np

from moetrain.bench.data import synthetic_corpus
from moetrain.data.shards import open_token_shards
from moetrain.data.tokenizer import ByteTokenizer


def test_synthetic_corpus_is_a_verified_stream_of_whole_documents(tmp_path):
    manifest = synthetic_corpus(tmp_path / "synthetic", n_tokens=300_000, shard_tokens=100_000, seed=0)
    tok = ByteTokenizer()
    shards = open_token_shards(tmp_path / "synthetic", "byte", tok)
    assert manifest["train_tokens"] + manifest["heldout_tokens"] >= 300_000
    assert len(shards.shards["train"]) >= 2 and shards.n_documents("heldout") >= 1
    for split in ("train", "heldout"):
        for shard in shards.shards[split]:
            tokens = np.asarray(shard.tokens)
            starts, ends = shard.offsets[:-1], shard.offsets[1:] - 1
            assert (tokens[starts] == tok.bos_id).all() and (tokens[ends] == tok.eos_id).all()
            inner = np.ones(tokens.size, dtype=bool)
            inner[starts] = inner[ends] = False
            assert (tokens[inner] < 256).all()
            assert shard.tokens.size <= 100_000 + 8192
    counts = shards.byte_histogram("train")
    assert sum(counts.values()) == sum(int((np.asarray(s.tokens) < 256).sum()) for s in shards.shards["train"])
