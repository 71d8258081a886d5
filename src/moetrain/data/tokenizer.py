"""Tokenizers: byte-level by default, a Hugging Face `tokenizers` JSON file optionally.

A tokenizer turns a document's text into token ids and back. Every tokenizer here
has the same three special tokens appended after its base vocabulary: BOS (starts
each document, so the first real token has something to be predicted from), EOS
(ends each document, so the model learns where documents stop) and PAD (fills the
tail of the last packed sequence). It also knows how many UTF-8 bytes each token
stands for, which bits-per-byte needs. It does not pack or batch anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from moetrain.errors import ConfigError

N_SPECIAL = 3


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of `text` (int32, no special tokens)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens dropped, invalid UTF-8 replaced."""
        ...

    def token_byte_lengths(self) -> torch.Tensor:
        """LongTensor[vocab_size]: UTF-8 bytes each token stands for (0 for special tokens)."""
        ...


@dataclass(frozen=True)
class ByteTokenizer:
    """256 byte values, then BOS = 256, EOS = 257, PAD = 258 (vocab 259)."""

    vocab_size: int = 256 + N_SPECIAL
    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258

    def encode(self, text: str) -> torch.Tensor:
        data = text.encode("utf-8")
        if not data:
            return torch.empty(0, dtype=torch.int32)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int32)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> torch.Tensor:
        lengths = torch.ones(self.vocab_size, dtype=torch.long)
        lengths[256:] = 0
        return lengths


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file; BOS/EOS/PAD are appended after its vocabulary.

    The special tokens are our own (ids base_vocab, +1, +2) rather than whatever the
    file defines, so packing and masking work the same for every tokenizer.
    """

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:
            raise ConfigError(f"data.tokenizer = {str(path)!r} needs the `tokenizers` package, which is not "
                              "installed; install the extra `pip install moetrain[hf]` or use 'byte'") from None
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - the library raises plain Exception subclasses
            raise ConfigError(f"data.tokenizer = {str(path)!r} is not a readable tokenizers JSON file: "
                              f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
        base = self._tok.get_vocab_size(with_added_tokens=True)
        self.base_vocab_size = base
        self.vocab_size = base + N_SPECIAL
        self.bos_id, self.eos_id, self.pad_id = base, base + 1, base + 2

    def encode(self, text: str) -> torch.Tensor:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return torch.tensor(ids, dtype=torch.int32)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if 0 <= i < self.base_vocab_size])

    def token_byte_lengths(self) -> torch.Tensor:
        # A single token of a byte-level BPE may be a partial UTF-8 character; decoding
        # it alone gives replacement characters, so this is an approximation for such
        # tokens (exact for whole-character tokens).
        lengths = [len(self._tok.decode([i]).encode("utf-8")) for i in range(self.base_vocab_size)]
        return torch.tensor(lengths + [0] * N_SPECIAL, dtype=torch.long)


def build_tokenizer(spec: str) -> Tokenizer:
    """'byte' -> ByteTokenizer; a path to a `tokenizers` JSON file -> HFTokenizer."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"data.tokenizer = {spec!r} is invalid: use 'byte' or the path of an existing "
                          "Hugging Face tokenizers JSON file")
    if path.suffix != ".json":
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            raise ConfigError(f"data.tokenizer = {spec!r} is not a JSON tokenizer file") from None
    return HFTokenizer(path)
