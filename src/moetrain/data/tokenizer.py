"""Tokenizers: byte-level by default, a Hugging Face `tokenizers` JSON file or model directory optionally.

A tokenizer turns a document's text into token ids and back. Every tokenizer has
three special tokens: BOS (starts each document, so the first real token has
something to be predicted from), EOS (ends each document, so the model learns where
documents stop) and PAD (fills the tail of the last packed sequence). The byte
tokenizer and a bare tokenizer JSON file get them appended after the base
vocabulary; a Hugging Face model directory (tokenizer.json beside config.json) uses
the model's own `bos_token_id` / `eos_token_id` / `pad_token_id` where they are set
and distinct, and appends only the missing ones, so a model fine-tuned here keeps
its document boundaries. The tokens a directory declares only in tokenizer_config.json
(`added_tokens_decoder`, the named special tokens, `extra_special_tokens`) are added as
transformers' loader adds them, so a text encodes to the ids `AutoTokenizer` gives it. A
tokenizer also knows how many UTF-8 bytes each token
stands for, which bits-per-byte needs (exact for byte-level BPE vocabularies).
`write_byte_level_tokenizer` writes the byte tokenizer as a tokenizer.json with the
same ids, so an exported model directory carries a tokenizer whatever it was
trained with. This module does not pack or batch anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import torch

from moetrain.data.chat import SPECIAL_TOKEN_NAMES, read_json_object, special_tokens, tokenizer_config
from moetrain.errors import ConfigError

N_SPECIAL = 3
# The special tokens of the byte tokenizer, by name, when written as a tokenizer.json.
BYTE_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[int, str]:
    """The GPT-2 byte-level BPE alphabet: byte value -> the printable character standing for it.

    Printable Latin-1 bytes stand for themselves; the others are shifted to code points from 256 on,
    in byte order (Radford et al. 2019, `bytes_to_unicode`; used by every byte-level BPE tokenizer).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[byte] = chr(byte)
        else:
            alphabet[byte] = chr(256 + shift)
            shift += 1
    return alphabet


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
    """A Hugging Face `tokenizers` JSON file, with BOS/EOS/PAD taken from `special_ids` or appended.

    `special_ids` ({"bos": id | None, "eos": ..., "pad": ...}, e.g. from a model's config.json):
    EOS is used when set; BOS when set and not EOS (packing needs them apart); PAD when set and
    neither BOS nor EOS. Each missing one gets the next id after the base vocabulary, in the
    order BOS, EOS, PAD, so packing and masking work the same for every tokenizer.
    """

    def __init__(self, path: str | Path, special_ids: dict[str, int | None] | None = None,
                 declared: dict[str, Any] | None = None):
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
        if declared:
            add_declared_tokens(self._tok, declared, str(path))
        base = self._tok.get_vocab_size(with_added_tokens=True)
        self.base_vocab_size = base
        given = special_ids or {}
        eos = given.get("eos")
        bos = given.get("bos") if given.get("bos") != eos else None
        pad = given.get("pad") if given.get("pad") not in (bos, eos) else None
        next_id = base
        chosen = {}
        for name, value in (("bos", bos), ("eos", eos), ("pad", pad)):
            if value is None:
                value, next_id = next_id, next_id + 1
            chosen[name] = int(value)
        self.bos_id, self.eos_id, self.pad_id = chosen["bos"], chosen["eos"], chosen["pad"]
        self.vocab_size = max(base, max(chosen.values()) + 1)

    def encode(self, text: str) -> torch.Tensor:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return torch.tensor(ids, dtype=torch.int32)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` (no special tokens added; special tokens written in it are parsed) and each
        token's character span, as transformers' tokenizer(..., add_special_tokens=False) gives them."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def special_token_ids(self) -> set[int]:
        """Ids of the tokenizer's added special tokens (those its JSON marks special)."""
        return {i for i, added in self._tok.get_added_tokens_decoder().items() if added.special}

    def token_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def decode(self, ids: list[int]) -> str:
        specials = {self.bos_id, self.eos_id, self.pad_id}
        return self._tok.decode([i for i in ids if 0 <= i < self.base_vocab_size and i not in specials])

    def _is_byte_level(self) -> bool:
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        return any(part.get("type") == "ByteLevel" for part in parts)

    def token_byte_lengths(self) -> torch.Tensor:
        """UTF-8 bytes per token: special and added special tokens 0; a byte-level BPE token exactly
        the number of its alphabet characters (one per byte, also for pieces of a multi-byte
        character); other tokens the length of their decoded text (an approximation for tokens
        that are partial characters)."""
        specials = {self.bos_id, self.eos_id, self.pad_id}
        specials.update(i for i, added in self._tok.get_added_tokens_decoder().items() if added.special)
        alphabet = set(byte_level_alphabet().values()) if self._is_byte_level() else set()
        lengths = []
        for i in range(self.base_vocab_size):
            piece = self._tok.id_to_token(i)
            if i in specials:
                lengths.append(0)
            elif alphabet and piece is not None and set(piece) <= alphabet:
                lengths.append(len(piece))
            else:
                lengths.append(len(self._tok.decode([i]).encode("utf-8")))
        lengths += [0] * (self.vocab_size - self.base_vocab_size)
        return torch.tensor(lengths, dtype=torch.long)


_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _added_token(value: Any, where: str, special: bool | None = None) -> Any:
    """An AddedToken from tokenizer_config.json's spelling of one: a string (a special token) or a dict."""
    from tokenizers import AddedToken

    if isinstance(value, str):
        return AddedToken(value, special=True if special is None else special)
    if not isinstance(value, dict) or not isinstance(value.get("content"), str):
        raise ConfigError(f"{where}: an added token is {str(value)[:60]!r}, not a string or a "
                          "{'content': ...} object")
    flags = {k: bool(value[k]) for k in _ADDED_TOKEN_FLAGS if k in value}
    if special is not None:
        flags["special"] = special or flags.get("special", False)
    return AddedToken(value["content"], **flags)


def _token_key(token: Any) -> tuple:
    return (token.content, *(getattr(token, k) for k in _ADDED_TOKEN_FLAGS))


def add_declared_tokens(tok: Any, declared: dict[str, Any], where: str) -> None:
    """Add what tokenizer_config.json declares beyond tokenizer.json, in transformers' order and ids.

    transformers' `TokenizersBackend` (tokenization_utils_tokenizers.py) adds, after loading
    tokenizer.json: the `added_tokens_decoder` entries by ascending id that differ from the file's own
    added tokens, then each named special token (`bos_token`, `eos_token`, ...) and each
    `extra_special_tokens` / `additional_special_tokens` entry not yet among them. A token already in
    the vocabulary keeps its id (and from then on is matched whole in text); a new one gets the next id.
    """
    existing = {_token_key(t) for t in tok.get_added_tokens_decoder().values()}
    decoder = declared.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise ConfigError(f"{where}: added_tokens_decoder is not an object of id -> token")
    try:
        ordered = sorted(decoder.items(), key=lambda item: int(item[0]))
    except ValueError:
        raise ConfigError(f"{where}: added_tokens_decoder has a key that is not a token id") from None
    to_add = [t for t in (_added_token(v, where) for _, v in ordered) if _token_key(t) not in existing]
    known = {t.content for t in tok.get_added_tokens_decoder().values()} | {t.content for t in to_add}
    named = [declared[name] for name in SPECIAL_TOKEN_NAMES if declared.get(name) is not None]
    extra = declared.get("extra_special_tokens") or declared.get("additional_special_tokens") or []
    extra = list(extra) if isinstance(extra, (list, dict)) else []
    for value in [*named, *extra]:
        token = _added_token(value, where, special=True)
        if token.content not in known:
            to_add.append(token)
            known.add(token.content)
    if to_add:
        tok.add_tokens(to_add)


def declared_tokens(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json's added tokens and special tokens (those of special_tokens_map.json too)."""
    config = tokenizer_config(directory)
    return {**config, **special_tokens(directory)}


def model_special_ids(model_dir: Path) -> dict[str, int | None]:
    """BOS/EOS/PAD ids from a Hugging Face model directory's config.json (None where unset or no file)."""
    config = model_dir / "config.json"
    if not config.is_file():
        return {}
    data = read_json_object(config)

    def first(value: object) -> int | None:
        if isinstance(value, list):
            value = value[0] if value else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return {"bos": first(data.get("bos_token_id")), "eos": first(data.get("eos_token_id")),
            "pad": first(data.get("pad_token_id"))}


def tokenizer_file(spec: str) -> Path | None:
    """The tokenizer.json a spec names (the file itself, or DIR/tokenizer.json); None for 'byte'."""
    if spec == "byte":
        return None
    path = Path(spec)
    return path / "tokenizer.json" if path.is_dir() else path


def build_tokenizer(spec: str) -> Tokenizer:
    """'byte' -> ByteTokenizer; a `tokenizers` JSON file or a model directory holding tokenizer.json -> HFTokenizer."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"data.tokenizer = {spec!r} is a directory without tokenizer.json")
        return HFTokenizer(path / "tokenizer.json", model_special_ids(path), declared_tokens(path))
    if not path.is_file():
        raise ConfigError(f"data.tokenizer = {spec!r} is invalid: use 'byte', the path of an existing "
                          "Hugging Face tokenizers JSON file or a model directory holding tokenizer.json")
    if path.suffix != ".json":
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            raise ConfigError(f"data.tokenizer = {spec!r} is not a JSON tokenizer file") from None
    return HFTokenizer(path)


FRAMINGS = ("bos_eos", "tokenizer")


def frames_with_bos(spec: str, tokenizer: Tokenizer, framing: str) -> bool:
    """Whether documents start with BOS under data.framing (every document ends with EOS either way).

    'bos_eos': always (the byte tokenizer's and the default job's framing, unchanged). 'tokenizer':
    as the tokenizer directory says: `add_bos_token` of tokenizer_config.json when it is set, else
    whether the tokenizer's own post-processor puts BOS before a text (as transformers' default
    `add_special_tokens=True` encoding does), so e.g. Qwen's tokenizers, which add none, get none.
    """
    if framing not in FRAMINGS:
        raise ConfigError(f"data.framing = {framing!r} is invalid: one of {', '.join(FRAMINGS)}")
    if framing == "bos_eos" or not isinstance(tokenizer, HFTokenizer):
        return True
    path = tokenizer_file(spec)
    config_path = path.parent / "tokenizer_config.json" if path is not None else None
    if config_path is not None and config_path.is_file():
        try:
            value = json.loads(config_path.read_text(encoding="utf-8")).get("add_bos_token")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            raise ConfigError(f"{config_path} is not valid JSON") from None
        if isinstance(value, bool):
            return value
    ids = tokenizer._tok.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == tokenizer.bos_id


def write_byte_level_tokenizer(path: str | Path) -> None:
    """Write the byte tokenizer as a `tokenizers` JSON file with the same ids.

    A byte-level BPE without merges: byte b is token b (its alphabet character), then the special
    tokens <|bos|>, <|eos|>, <|pad|> as ids 256, 257, 258. Loaded with the matching config.json
    (bos/eos/pad ids 256-258) it encodes, decodes and counts bytes exactly like `ByteTokenizer`. Its
    post-processor puts <|bos|> before a text, as training framed every document, so transformers'
    default encoding (`add_special_tokens=True`) gives a prompt the start the model was trained on.
    """
    try:
        from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as _HFTokenizer
    except ImportError:
        raise ConfigError("writing tokenizer.json needs the `tokenizers` package, which is not installed; "
                          "install the extra `pip install moetrain[hf]`") from None
    vocab = {char: byte for byte, char in byte_level_alphabet().items()}
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True) for name in BYTE_SPECIAL_TOKENS])
    bos = BYTE_SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, ByteTokenizer.bos_id)])
    tok.save(str(path))
