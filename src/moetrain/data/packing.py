"""Packing: documents -> fixed-length sequences with document ids, positions and targets.

Each document becomes `[BOS] tokens [EOS]` and all documents are concatenated into
one flat stream, padded with PAD at the end. Sequence i is the window
stream[i*S : i*S + S + 1]: its first S tokens are the inputs and the S tokens after
each input are the candidate targets (windows overlap by one token, so the last
input of a window is still trained on the first token of the next window).

Per input position:
- `document_ids` count documents inside the sequence from 0; a new document starts
  at position 0 and after every EOS. PAD filler is a document of its own. The
  model's document masking only lets a token attend within its document.
- `positions` restart at 0 at every document start. A document cut by a window
  boundary continues in the next window at position 0: it cannot see its first
  part there, and RoPE only depends on position differences, so this is exact for
  what the model can see.
- `targets` are the next token within the same document, else -100: after an EOS
  (the next token is another document's BOS), on PAD, and before PAD. So BOS
  predicts the first real token, the last real token predicts EOS, and EOS
  predicts nothing.

The stream is a `TokenStream`: one in-memory array, or the memory-mapped token files
of prepared shards (moetrain.data.shards) read in order. A window is copied out of it
when asked for, crossing shard boundaries as needed, and the PAD tail is virtual
(positions past the end read as PAD), so the stream is never loaded or copied whole.
`PackedSequences.document_starts` gives the stream offset of every document's BOS.

This module only turns token streams into tensors; it opens no files and does no
sharding or shuffling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moetrain.data.corpus import Document
from moetrain.data.tokenizer import Tokenizer
from moetrain.errors import ConfigError

IGNORE_INDEX = -100


@dataclass
class Batch:
    """A microbatch of packed sequences, all LongTensor[B, S]."""

    tokens: torch.Tensor
    positions: torch.Tensor
    document_ids: torch.Tensor
    targets: torch.Tensor

    @property
    def n_valid_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in
                       (self.tokens, self.positions, self.document_ids, self.targets)))


def encode_documents(documents: list[Document], tokenizer: Tokenizer, bos: bool = True) -> torch.Tensor:
    """One int32 stream: [BOS] doc0 [EOS] [BOS] doc1 [EOS] ... (without the BOS when not `bos`:
    data.framing = 'tokenizer' for a tokenizer that adds none)."""
    bos = torch.tensor([tokenizer.bos_id] if bos else [], dtype=torch.int32)
    eos = torch.tensor([tokenizer.eos_id], dtype=torch.int32)
    pieces: list[torch.Tensor] = []
    for doc in documents:
        pieces += [bos, tokenizer.encode(doc.text), eos]
    if not pieces:
        return torch.empty(0, dtype=torch.int32)
    return torch.cat(pieces)


def sequence_fields(window: torch.Tensor, eos_id: int, pad_id: int, starts: torch.Tensor | None = None,
                    keep: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Inputs, positions, document ids and targets of one window of S + 1 tokens.

    Without `starts`, documents are `[BOS] tokens [EOS]` and start after each EOS. With `starts`
    (bool[S + 1]: a document begins at that window position) and `keep` (the loss mask of the
    window's tokens, as conversations carry it: their template text holds end-of-turn tokens
    that may be the EOS id, so EOS cannot mark where a conversation ends), a target is kept
    only when it belongs to the same document and its mask is 1.
    """
    window = window.long()
    inputs, following = window[:-1], window[1:]
    length = inputs.numel()
    if starts is None:
        starts_in = torch.zeros(length, dtype=torch.bool)
        starts_in[1:] = inputs[:-1] == eos_id
        no_target = (inputs == eos_id) | (inputs == pad_id) | (following == pad_id)
    else:
        starts_in = starts[:-1].clone()
        no_target = starts[1:].clone()
    starts_in[0] = True
    if keep is not None:
        no_target |= keep[1:] == 0
    document_ids = torch.cumsum(starts_in.long(), dim=0) - 1
    index = torch.arange(length)
    start_index = torch.cummax(torch.where(starts_in, index, torch.zeros_like(index)), dim=0).values
    positions = index - start_index
    targets = torch.where(no_target, torch.full_like(following, IGNORE_INDEX), following)
    return {"tokens": inputs, "positions": positions, "document_ids": document_ids, "targets": targets}


class TokenStream:
    """Read-only concatenation of 1-D token arrays (in memory or memory-mapped); past the end reads PAD.

    Holds only the pieces and their start offsets: `read` copies the asked range out of the
    one or more pieces it crosses, so a multi-shard stream is never loaded whole.
    """

    def __init__(self, pieces: Sequence[np.ndarray], pad_id: int,
                 first_read_checks: Sequence[Callable[[], None] | None] | None = None, vocab_size: int | None = None):
        checks = list(first_read_checks) if first_read_checks is not None else [None] * len(pieces)
        # Token ids read must be below the tokenizer's vocabulary: a shard whose checksums agree with its manifest
        # can still hold ids of another tokenizer, which the embedding would index out of range.
        self.vocab_size = vocab_size
        kept = [i for i, p in enumerate(pieces) if p.size]
        self.pieces = [pieces[i] for i in kept]
        # Per piece, run once before its first read (a shard file's deferred sha256 check), then dropped.
        self._checks = [checks[i] for i in kept]
        self.pad_id = pad_id
        self.starts = np.cumsum([0] + [p.size for p in self.pieces], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """int64[stop - start]: tokens start..stop-1, PAD where past the end."""
        out = np.full(stop - start, self.pad_id, dtype=np.int64)
        position = start
        piece = int(np.searchsorted(self.starts, start, side="right")) - 1
        while position < min(stop, len(self)):
            check = self._checks[piece]
            if check is not None:
                check()
                self._checks[piece] = None
            local = position - int(self.starts[piece])
            take = min(stop, int(self.starts[piece + 1])) - position
            chunk = self.pieces[piece][local: local + take]
            if self.vocab_size is not None and take and int(chunk.max()) >= self.vocab_size:
                name = getattr(self.pieces[piece], "filename", None) or f"token piece {piece}"
                raise ConfigError(f"shard file {name} holds token id {int(chunk.max())}, outside the tokenizer's "
                                  f"{self.vocab_size} ids: it was prepared with another tokenizer or damaged; "
                                  "prepare it again")
            out[position - start: position - start + take] = chunk
            position += take
            piece += 1
        return out

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a TokenStream is read by contiguous slices")
        start, stop, _ = key.indices(len(self))
        return self.read(start, max(start, stop))


def starts_after_eos(stream: TokenStream, eos_id: int) -> np.ndarray:
    """Document starts of a `[BOS] tokens [EOS]` stream: 0 and every position after an EOS (one pass)."""
    if not len(stream):
        return np.zeros(0, dtype=np.int64)
    ends = [np.flatnonzero(piece == eos_id) + base for piece, base in zip(stream.pieces, stream.starts[:-1])]
    after = np.concatenate([np.zeros(1, dtype=np.int64), *(e + 1 for e in ends)])
    return after[after < len(stream)]


class PackedSequences:
    """Fixed-length sequences over a token stream; sequence(i) is cheap (a copied window)."""

    def __init__(self, stream: torch.Tensor | TokenStream, seq_len: int, eos_id: int, pad_id: int,
                 document_starts: np.ndarray | None = None, loss_mask: TokenStream | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if isinstance(stream, torch.Tensor):
            stream = TokenStream([stream.numpy()], pad_id)
        self.seq_len = seq_len
        self.eos_id, self.pad_id = eos_id, pad_id
        self.stream = stream
        self.n_sequences = max(0, -(-(len(stream) - 1) // seq_len))
        # int64[n_documents]: the stream offset of each document's BOS (sorted), for token-budget batching.
        self.document_starts = (starts_after_eos(stream, eos_id) if document_starts is None
                                else np.asarray(document_starts, dtype=np.int64))
        # uint8 per stream token (conversations): 1 where the token is a target to learn; past the end 0.
        # With it, documents start at document_starts (which must be given) rather than after each EOS.
        if loss_mask is not None and (document_starts is None or len(loss_mask) != len(stream)):
            raise ValueError("a loss mask needs explicit document starts and one value per stream token")
        self.loss_mask = loss_mask

    def __len__(self) -> int:
        return self.n_sequences

    def window(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.n_sequences:
            raise IndexError(f"sequence {index} out of range [0, {self.n_sequences})")
        start = index * self.seq_len
        return torch.from_numpy(self.stream.read(start, start + self.seq_len + 1))

    def fields(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """`sequence_fields` of the stream tokens start..stop-1 (stop - start - 1 inputs)."""
        window = torch.from_numpy(self.stream.read(start, stop))
        if self.loss_mask is None:
            return sequence_fields(window, self.eos_id, self.pad_id)
        starts = np.zeros(stop - start, dtype=np.bool_)
        lo, hi = np.searchsorted(self.document_starts, [start, stop])
        starts[self.document_starts[lo:hi] - start] = True
        if start <= len(self.stream) < stop:
            starts[len(self.stream) - start] = True  # the PAD tail is a document of its own
        keep = torch.from_numpy(self.loss_mask.read(start, stop))
        return sequence_fields(window, self.eos_id, self.pad_id, torch.from_numpy(starts), keep)

    def batch(self, indices: list[int]) -> Batch:
        for i in indices:
            if not 0 <= i < self.n_sequences:
                raise IndexError(f"sequence {i} out of range [0, {self.n_sequences})")
        fields = [self.fields(i * self.seq_len, i * self.seq_len + self.seq_len + 1) for i in indices]
        return Batch(**{key: torch.stack([f[key] for f in fields]) for key in fields[0]})


def pack_documents(documents: list[Document], tokenizer: Tokenizer, seq_len: int, bos: bool = True) -> PackedSequences:
    return PackedSequences(encode_documents(documents, tokenizer, bos), seq_len, tokenizer.eos_id, tokenizer.pad_id)
