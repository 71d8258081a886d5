"""What a training run gets from the data layer: packed train and held-out sequences, the tokenizer, statistics.

`load_training_data(cfg)` reads the configured corpus, splits it, tokenizes and packs
both sides, and measures the unigram byte entropy of each side: the bits per byte a
model that ignores context would reach, the reference the held-out bits per byte are
read against. With data.source = 'tokens' it instead checks and memory-maps prepared
shards (moetrain.data.shards): the split and the byte counts come from the manifest,
and nothing of size O(tokens) is read into memory. Bad data raises a one-line
ConfigError before anything is written. This module assembles data; it does no
batching, sharding or I/O beyond the corpus.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moetrain.config.job import JobConfig
from moetrain.data.batching import MixedSequences
from moetrain.data.chat import load_chat_template
from moetrain.data.corpus import load_corpus
from moetrain.data.packing import PackedSequences, TokenStream, pack_documents
from moetrain.data.shards import TokenShards, open_token_shards
from moetrain.data.tokenizer import Tokenizer, build_tokenizer, frames_with_bos
from moetrain.errors import ConfigError


@dataclass
class TrainingData:
    tokenizer: Tokenizer
    train: PackedSequences
    heldout: PackedSequences | None
    token_bytes: torch.Tensor
    unigram_entropy_bits: float | None
    train_unigram_entropy_bits: float
    n_train_documents: int
    n_heldout_documents: int


def byte_histogram(texts: Iterable[str]) -> Counter[int]:
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(text.encode("utf-8"))
    return counts


def unigram_entropy_bits(byte_counts: Counter[int] | dict[int, int]) -> float:
    """Entropy (bits per byte) of the empirical byte distribution: the best any unigram model can do."""
    total = sum(byte_counts.values())
    return -sum(c / total * math.log2(c / total) for c in byte_counts.values() if c > 0)


def load_training_data(cfg: JobConfig) -> TrainingData:
    """Read, split, tokenize and pack the corpus (raises ConfigError for bad data)."""
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size} is invalid: the tokenizer "
                          f"{cfg.data.tokenizer!r} needs at least {tokenizer.vocab_size}")
    if cfg.data.source == "tokens":
        return _shard_training_data(cfg, tokenizer)
    corpus = load_corpus(cfg.data)
    bos = frames_with_bos(cfg.data.tokenizer, tokenizer, cfg.data.framing)
    train = pack_documents(corpus.train, tokenizer, cfg.data.seq_len, bos)
    heldout = pack_documents(corpus.heldout, tokenizer, cfg.data.seq_len, bos) if corpus.heldout else None
    entropy = unigram_entropy_bits(byte_histogram(d.text for d in corpus.heldout)) if corpus.heldout else None
    train_entropy = unigram_entropy_bits(byte_histogram(d.text for d in corpus.train))
    return TrainingData(tokenizer, train, heldout, tokenizer.token_byte_lengths(), entropy, train_entropy,
                        len(corpus.train), len(corpus.heldout))


def _packed_split(shard_sets: TokenShards | list[TokenShards], split: str, tokenizer: Tokenizer,
                  seq_len: int) -> PackedSequences:
    """One split of one prepared directory, or of several concatenated in order (a mixture's held-out)."""
    sets = shard_sets if isinstance(shard_sets, list) else [shard_sets]
    pieces = [s for shards in sets for s in shards.shards[split]]
    stream = TokenStream([s.tokens for s in pieces], tokenizer.pad_id, [s.check_tokens for s in pieces],
                         vocab_size=tokenizer.vocab_size)
    bases = np.cumsum([0] + [s.tokens.size for s in pieces[:-1]], dtype=np.int64)
    starts = np.concatenate([s.offsets[:-1] + base for s, base in zip(pieces, bases)]) if pieces else None
    loss_mask = None
    if any("chat" in shards.manifest for shards in sets):  # conversations: every shard carries its loss mask
        if any(s.mask is None for s in pieces):
            raise ConfigError(f"{', '.join(str(sh.root) for sh in sets)}: conversations and text documents (or "
                              f"a {split} shard without its loss mask) cannot share one split; prepare them alike")
        loss_mask = TokenStream([s.mask for s in pieces], 0, [s.check_mask for s in pieces])  # type: ignore[misc]
        starts = starts if starts is not None else np.zeros(0, dtype=np.int64)
    return PackedSequences(stream, seq_len, tokenizer.eos_id, tokenizer.pad_id, document_starts=starts,
                           loss_mask=loss_mask)


def check_chat_template(cfg: JobConfig, shards: TokenShards) -> None:
    """Conversations train only with the template they were rendered with (one-line ConfigError otherwise)."""
    chat = shards.manifest.get("chat")
    if chat is None:
        return
    template = load_chat_template(cfg.data.tokenizer, cfg.data.chat_template)
    if template.sha256 != chat["template_sha256"]:
        raise ConfigError(f"{shards.root / 'manifest.json'} holds conversations rendered with chat template "
                          f"sha256 {chat['template_sha256'][:12]}, but data.tokenizer = {cfg.data.tokenizer!r} "
                          f"with data.chat_template = {cfg.data.chat_template!r} gives {template.sha256[:12]}; train "
                          "with the template they were prepared with, or prepare them again")


def _open_prepared(cfg: JobConfig, tokenizer: Tokenizer, path: str) -> TokenShards:
    """A prepared directory checked against the job: tokenizer, chat template, framing, held-out fraction."""
    d = cfg.data
    # Sizes and headers now, each token file's sha256 when it is first read (moetrain.data.shards).
    shards = open_token_shards(Path(path), d.tokenizer, tokenizer, hash_on_first_read=True)
    check_chat_template(cfg, shards)
    framing = shards.manifest.get("framing", "bos_eos")  # (manifests from before the option: always BOS)
    if "chat" not in shards.manifest and framing != d.framing:
        raise ConfigError(f"data.framing = {d.framing!r} differs from {shards.root / 'manifest.json'} ({framing!r}): "
                          f"documents are framed by `moetrain data prepare --framing`; set --data.framing {framing}")
    manifest_fraction = shards.manifest["heldout_fraction"]
    if d.heldout_fraction != manifest_fraction:
        raise ConfigError(f"data.heldout_fraction = {d.heldout_fraction} differs from {shards.root / 'manifest.json'}"
                          f" ({manifest_fraction}): the split is made by `moetrain data prepare --heldout-fraction`; "
                          f"set --data.heldout_fraction {manifest_fraction}")
    return shards


def _shard_training_data(cfg: JobConfig, tokenizer: Tokenizer) -> TrainingData:
    """Memory-mapped prepared shards (data.source = 'tokens'), verified before anything else happens."""
    d = cfg.data
    if d.max_documents is not None:
        raise ConfigError("data.max_documents cannot limit data.source = 'tokens'; prepare fewer documents instead")
    mixture = d.mixture_weights()
    sets = [_open_prepared(cfg, tokenizer, path) for path, _ in mixture] or [_open_prepared(cfg, tokenizer,
                                                                                           d.path or "")]
    sources = [_packed_split(shards, "train", tokenizer, d.seq_len) for shards in sets]
    train: PackedSequences | MixedSequences = (
        MixedSequences(sources, [w for _, w in mixture], [p for p, _ in mixture]) if mixture else sources[0])
    n_heldout = sum(shards.n_documents("heldout") for shards in sets)
    heldout = _packed_split(sets, "heldout", tokenizer, d.seq_len) if n_heldout else None
    histograms = {split: Counter() for split in ("train", "heldout")}
    for shards in sets:
        for split in histograms:
            histograms[split].update(shards.byte_histogram(split))
    entropy = unigram_entropy_bits(histograms["heldout"]) if n_heldout else None
    train_entropy = unigram_entropy_bits(histograms["train"])
    return TrainingData(tokenizer, train, heldout, tokenizer.token_byte_lengths(), entropy, train_entropy,  # type: ignore[arg-type]
                        sum(shards.n_documents("train") for shards in sets), n_heldout)
