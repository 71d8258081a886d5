"""Batching: what one microbatch is made of, in units the loader's global order permutes.

A *unit* is the thing moetrain.data.loader shuffles: every epoch visits each unit once,
in a seeded order that does not depend on the number of ranks. `data.batching` picks
what a unit is and how units become a microbatch:

- "packed": a unit is one packed sequence of `data.seq_len` tokens
  (moetrain.data.packing); a microbatch stacks `train.microbatch_size` of them into
  [B, S] tensors. Every microbatch has the same shape.
- "token_budget": a unit is one *bin* of whole documents whose lengths add up to at
  most `data.token_budget` tokens, concatenated into one row ([1, L], L <= budget).
  Document ids count the documents of the row and positions restart at each, so the
  model's document masking keeps them apart. A document longer than the budget is cut
  into budget-size pieces, each its own document in the row it lands in (positions
  restart at 0, as for a document cut by a packed-sequence boundary; the last token of
  a piece still predicts the first token of the next piece). A microbatch is one bin, so
  microbatches differ in length and cost across ranks and steps; the trainer divides by
  the step's global valid-token count, so every token weighs the same.

Bins are fixed for the whole run: the documents are laid out once in a seeded order
(`train.seed`), cut into pieces, and bins are filled in that order, each taking the
next pieces while they fit (next fit, so a bin never skips a document that fits). Only
the order of the bins changes from epoch to epoch (the loader's permutation). Why fixed
bins rather than repacking every epoch: the number of units per epoch stays constant,
so the loader maps a global unit index to (epoch, unit) in O(1) without replaying
earlier epochs, its state is one integer, and nothing is held per epoch beyond one
permutation. The cost is that the same documents share a bin in every epoch; they
cannot attend to each other, so only the grouping of gradients repeats, as it does for
packed sequences, which always hold the same neighbours.

Documents come from `PackedSequences.document_starts` (the stream offset of each
document's BOS); the last document ends at the last non-PAD token of the stream. A
layout costs 16 bytes per piece and 8 per bin; token ranges are read from the stream
only when a microbatch is built, so a memory-mapped stream is never loaded whole.
This module builds microbatches from units; it does no shuffling, rank slicing or file I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from moetrain.config.data import DataConfig
from moetrain.data.packing import Batch, PackedSequences
from moetrain.errors import ConfigError

# Salt of the document layout's generator, so it draws a stream of its own rather than
# the loader's epoch permutations (which are seeded by train.seed alone).
_LAYOUT_STREAM = 0x62696E73


class Batching(Protocol):
    """How units become a microbatch (PackedBatching or TokenBudgetBatching)."""

    n_units: int
    units_per_microbatch: int

    def microbatch(self, units: Sequence[int]) -> Batch: ...

    def signature(self) -> dict[str, Any]:
        """What a loader position depends on; a checkpoint's must match to resume."""
        ...


class PackedBatching:
    """Units are packed sequences; a microbatch is `microbatch_size` of them, stacked."""

    def __init__(self, sequences: PackedSequences, microbatch_size: int):
        self.sequences = sequences
        self.n_units = len(sequences)
        self.units_per_microbatch = microbatch_size

    def microbatch(self, units: Sequence[int]) -> Batch:
        return self.sequences.batch([int(u) for u in units])

    def signature(self) -> dict[str, Any]:
        return {"batching": "packed", "n_units": self.n_units, "seq_len": self.sequences.seq_len}


def documents_end(stream: Any, pad_id: int, block: int = 4096) -> int:
    """Where the last document ends: after the stream's last non-PAD token.

    An in-memory stream is padded to whole sequences; a memory-mapped one is not. Only
    the PAD tail is scanned, from the end.
    """
    end = len(stream)
    while end > 0:
        tail = np.asarray(stream[max(0, end - block): end])
        real = np.flatnonzero(tail != pad_id)
        if real.size:
            return end - tail.size + int(real[-1]) + 1
        end -= tail.size
    return 0


class BinLayout:
    """Documents cut into pieces of at most `budget` tokens and grouped into bins (next fit).

    Bin b holds pieces bin_offsets[b]:bin_offsets[b + 1] of (piece_starts, piece_lengths),
    in that order; every bin's lengths add up to at most `budget`.
    """

    def __init__(self, document_starts: np.ndarray, end: int, budget: int, seed: int):
        starts = np.asarray(document_starts, dtype=np.int64)
        lengths = np.diff(np.append(starts, np.int64(end)))
        order = np.random.default_rng([seed, _LAYOUT_STREAM]).permutation(starts.size)
        pieces_per_document = -(-lengths[order] // budget)
        document = np.repeat(order, pieces_per_document)
        first_piece = np.repeat(np.cumsum(pieces_per_document) - pieces_per_document, pieces_per_document)
        offset = (np.arange(document.size) - first_piece) * budget
        self.piece_starts = starts[document] + offset
        self.piece_lengths = np.minimum(lengths[document] - offset, budget)
        # Next fit on prefix sums: a bin starting at piece i takes pieces i..j-1, the
        # longest run whose lengths add up to at most the budget (one piece always fits).
        prefix = np.concatenate([[0], np.cumsum(self.piece_lengths)])
        offsets = [0]
        while offsets[-1] < self.piece_lengths.size:
            first = offsets[-1]
            offsets.append(int(np.searchsorted(prefix, prefix[first] + budget, side="right")) - 1)
        self.bin_offsets = np.asarray(offsets, dtype=np.int64)
        self.budget = budget

    def __len__(self) -> int:
        return self.bin_offsets.size - 1

    def pieces(self, bin_index: int) -> list[tuple[int, int]]:
        """(stream start, length) of the pieces of one bin, in row order."""
        lo, hi = self.bin_offsets[bin_index], self.bin_offsets[bin_index + 1]
        return [(int(s), int(n)) for s, n in zip(self.piece_starts[lo:hi], self.piece_lengths[lo:hi])]

    def bin_tokens(self) -> np.ndarray:
        """int64[n_bins]: the tokens in each bin."""
        return np.add.reduceat(self.piece_lengths, self.bin_offsets[:-1]) if len(self) else np.zeros(0, np.int64)


class TokenBudgetBatching:
    """Units are bins of whole documents (or budget-size pieces) of at most `token_budget` tokens, one row each."""

    units_per_microbatch = 1

    def __init__(self, sequences: PackedSequences, token_budget: int, seed: int):
        self.sequences = sequences
        self.stream = sequences.stream
        self.eos_id, self.pad_id = sequences.eos_id, sequences.pad_id
        self.token_budget = token_budget
        # Conversations (a loss mask) end where the stream ends: their last token may be the PAD id.
        end = len(self.stream) if sequences.loss_mask is not None else documents_end(self.stream, self.pad_id)
        self.layout = BinLayout(sequences.document_starts, end, token_budget, seed)
        self.n_units = len(self.layout)

    def microbatch(self, units: Sequence[int]) -> Batch:
        if len(units) != 1:
            raise ValueError(f"a token-budget microbatch is one bin, got {len(units)} units")
        fields: list[dict[str, torch.Tensor]] = []
        documents_before = 0
        for start, length in self.layout.pieces(int(units[0])):
            # One token more than the piece: the target of its last input (the next piece of
            # the same document, or the next document's BOS that EOS never predicts).
            piece = self.sequences.fields(start, start + length + 1)
            piece["document_ids"] = piece["document_ids"] + documents_before
            documents_before = int(piece["document_ids"][-1]) + 1
            fields.append(piece)
        return Batch(**{key: torch.cat([f[key] for f in fields]).unsqueeze(0) for key in fields[0]})

    def signature(self) -> dict[str, Any]:
        return {"batching": "token_budget", "n_units": self.n_units, "token_budget": self.token_budget}


@dataclass
class MixedSequences:
    """The training sequences of several prepared directories (data.mixture) and their weights."""

    sources: list[PackedSequences]
    weights: list[float]
    names: list[str]

    def __len__(self) -> int:
        """Packed sequences over all sources (what a run reports as its training sequences)."""
        return sum(len(source) for source in self.sources)


# Global units per mixture block: each block holds every source's quota exactly (to 1 / MIXTURE_BLOCK).
MIXTURE_BLOCK = 10_000
_MIXTURE_STREAM = 0x6D6978


def _permutation(n: int, seed: int, stream: int, index: int) -> np.ndarray:
    generator = torch.Generator().manual_seed((seed * 1_000_003 + index) * 65_537 + stream)
    return torch.randperm(n, generator=generator).numpy()


class MixtureBatching:
    """Units drawn from several sources' batchings in proportion to their weights, by global index alone.

    The loader hands this batching global unit indices (`takes_global_indices`), not its own
    permutation's units. Global index g lies in block b = g div B (B = MIXTURE_BLOCK); each block
    gives source s exactly c_s slots (the weights' largest-remainder quota of B), in a seeded
    order per block; the j-th slot of source s in block b is that source's k-th draw, k = b·c_s + j,
    which is unit perm_{s,e}[k mod n_s] of source s, epoch e = k div n_s. So each source is read
    in its own epoch order (every unit once per source epoch), each block's shares are exact, and
    what step t reads is a function of (seed, t) only: the same on any number of ranks, and after a
    resume on another.
    """

    takes_global_indices = True

    def __init__(self, sources: list[Batching], weights: list[float], seed: int, block: int = MIXTURE_BLOCK):
        if len({b.units_per_microbatch for b in sources}) != 1:
            raise ConfigError("data.mixture sources must batch alike (the same units per microbatch)")
        self.sources, self.seed, self.block = sources, seed, block
        share = np.asarray(weights, dtype=np.float64) / float(sum(weights))
        quota = np.floor(share * block).astype(np.int64)
        remainder = share * block - quota
        quota[np.argsort(-remainder, kind="stable")[: block - int(quota.sum())]] += 1
        self.quota = quota
        self.quota_starts = np.concatenate([[0], np.cumsum(quota)])
        self.weights = [float(w) for w in weights]
        self.n_units = block
        self.units_per_microbatch = sources[0].units_per_microbatch
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def _order(self, stream: int, n: int, index: int) -> np.ndarray:
        key = (stream, index)
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = _permutation(n, self.seed, _MIXTURE_STREAM + stream, index)
        return self._cache[key]

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each position, its rank among that source's positions) of one block."""
        key = (-1, block)
        if key not in self._cache:
            slots = self._order(0, self.block, block)
            source = np.searchsorted(self.quota_starts, slots, side="right") - 1
            order = np.argsort(source, kind="stable")
            rank = np.empty(self.block, dtype=np.int64)
            rank[order] = np.arange(self.block) - self.quota_starts[source[order]]
            self._cache[key] = np.stack([source, rank])
        return self._cache[key][0], self._cache[key][1]

    def source_unit(self, global_index: int) -> tuple[int, int]:
        """(source, that source's unit) at a global index."""
        block, position = divmod(int(global_index), self.block)
        sources, ranks = self._block(block)
        source = int(sources[position])
        k = block * int(self.quota[source]) + int(ranks[position])
        n = self.sources[source].n_units
        epoch, offset = divmod(k, n)
        return source, int(self._order(source + 1, n, epoch)[offset])

    def microbatch(self, units: Sequence[int]) -> Batch:
        parts = [self.source_unit(g) for g in units]
        if len({s for s, _ in parts}) == 1:
            return self.sources[parts[0][0]].microbatch([u for _, u in parts])
        batches = [self.sources[s].microbatch([u]) for s, u in parts]  # packed: equal seq_len, rows stack
        return Batch(*(torch.cat(fields) for fields in zip(*((b.tokens, b.positions, b.document_ids, b.targets)
                                                              for b in batches))))

    def signature(self) -> dict[str, Any]:
        return {"batching": "mixture", "n_units": self.n_units, "weights": self.weights,
                "sources": [b.signature() for b in self.sources]}


def build_batching(sequences: PackedSequences | MixedSequences, data: DataConfig, microbatch_size: int,
                   seed: int) -> Batching:
    """The configured batching over the training sequences (ConfigError when there is nothing to batch)."""
    if isinstance(sequences, MixedSequences):
        parts = [build_batching(source, data, microbatch_size, seed) for source in sequences.sources]
        return MixtureBatching(parts, sequences.weights, seed)
    batching: Batching
    if data.batching == "token_budget":
        batching = TokenBudgetBatching(sequences, data.token_budget or data.seq_len, seed)
    else:
        batching = PackedBatching(sequences, microbatch_size)
    if batching.n_units == 0:
        raise ConfigError(f"the training data has no tokens to batch (data.batching = {data.batching!r}); "
                          "use more data or a smaller data.heldout_fraction")
    return batching
