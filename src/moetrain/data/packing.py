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

This module only turns token streams into tensors; it reads no files and does no
sharding or shuffling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moetrain.data.corpus import Document
from moetrain.data.tokenizer import Tokenizer

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


def encode_documents(documents: list[Document], tokenizer: Tokenizer) -> torch.Tensor:
    """One int32 stream: [BOS] doc0 [EOS] [BOS] doc1 [EOS] ..."""
    bos = torch.tensor([tokenizer.bos_id], dtype=torch.int32)
    eos = torch.tensor([tokenizer.eos_id], dtype=torch.int32)
    pieces: list[torch.Tensor] = []
    for doc in documents:
        pieces += [bos, tokenizer.encode(doc.text), eos]
    if not pieces:
        return torch.empty(0, dtype=torch.int32)
    return torch.cat(pieces)


def sequence_fields(window: torch.Tensor, eos_id: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Inputs, positions, document ids and targets of one window of S + 1 tokens."""
    window = window.long()
    inputs, following = window[:-1], window[1:]
    length = inputs.numel()
    starts = torch.zeros(length, dtype=torch.bool)
    starts[0] = True
    starts[1:] = inputs[:-1] == eos_id
    document_ids = torch.cumsum(starts.long(), dim=0) - 1
    index = torch.arange(length)
    start_index = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=0).values
    positions = index - start_index
    no_target = (inputs == eos_id) | (inputs == pad_id) | (following == pad_id)
    targets = torch.where(no_target, torch.full_like(following, IGNORE_INDEX), following)
    return {"tokens": inputs, "positions": positions, "document_ids": document_ids, "targets": targets}


def document_starts(stream: torch.Tensor, eos_id: int) -> np.ndarray:
    """Offsets of the documents of a `[BOS] tokens [EOS] ...` stream: 0 and every position after an EOS."""
    if stream.numel() == 0:
        return np.zeros(0, dtype=np.int64)
    after_eos = torch.nonzero(stream == eos_id).flatten() + 1
    return torch.cat([torch.zeros(1, dtype=torch.long), after_eos[after_eos < stream.numel()]]).numpy()


class PackedSequences:
    """Fixed-length sequences over a token stream; sequence(i) is cheap (a slice)."""

    def __init__(self, stream: torch.Tensor, seq_len: int, eos_id: int, pad_id: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = seq_len
        self.eos_id, self.pad_id = eos_id, pad_id
        # int64[n_documents]: the stream offset of each document's BOS (token-budget batching).
        self.document_starts = document_starts(stream, eos_id)
        n_sequences = max(0, -(-(stream.numel() - 1) // seq_len))
        padded = n_sequences * seq_len + 1
        pad = torch.full((max(0, padded - stream.numel()),), pad_id, dtype=stream.dtype)
        self.stream = torch.cat([stream, pad]) if n_sequences else stream
        self.n_sequences = n_sequences

    def __len__(self) -> int:
        return self.n_sequences

    def window(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.n_sequences:
            raise IndexError(f"sequence {index} out of range [0, {self.n_sequences})")
        start = index * self.seq_len
        return self.stream[start: start + self.seq_len + 1]

    def batch(self, indices: list[int]) -> Batch:
        fields = [sequence_fields(self.window(i), self.eos_id, self.pad_id) for i in indices]
        return Batch(**{key: torch.stack([f[key] for f in fields]) for key in fields[0]})


def pack_documents(documents: list[Document], tokenizer: Tokenizer, seq_len: int) -> PackedSequences:
    return PackedSequences(encode_documents(documents, tokenizer), seq_len, tokenizer.eos_id, tokenizer.pad_id)
