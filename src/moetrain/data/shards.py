"""Token shards on disk: the format, the manifest, writing one shard safely, and the memory-mapped reader.

A prepared directory (written by `moetrain data prepare`, see moetrain.data.prepare) holds

    manifest.json                        what is there (written last: no manifest, no dataset)
    train/shard_00000.tokens.npy         the token stream of the shard's documents: [BOS] ids [EOS] ...
    train/shard_00000.offsets.npy        int64[n_documents + 1]: where each document's BOS starts, then the end
    train/shard_00000.mask.npy           conversations only (--format chat): uint8 per token, 1 where the
                                         token is a target to learn (the assistant's), 0 elsewhere
    train/shard_00000.json               the shard's manifest entry, written once the two files are in place
    heldout/...                          the same for the held-out documents

Token files are `.npy` arrays (numpy's own header, read with allow_pickle=False), uint16
when the vocabulary fits, else uint32. Concatenating a split's token files in shard order
gives exactly the stream packing builds in memory for the same documents, so sequence i
is the same window whichever way the data arrived.

Every file is written under a temporary name, fsynced and renamed, so a file with a final
name is complete; a shard's entry (its sizes and sha256 checksums) is written after both
of its files, so an entry means a finished shard, which is never rewritten.

`open_token_shards` checks a directory before training: the manifest, the tokenizer it was
made with against the job's, and for every shard file its presence, dtype, size and
sha256. Each problem is a one-line ConfigError naming the file. A training run
(moetrain.data.dataset) checks presence, headers and sizes of every file and the sha256
of the small offsets files at start, and defers each token and mask file's sha256 to the
first read of that file (`hash_on_first_read`): start-up then costs O(shards + documents),
not a pass over the corpus (hashing ran at about 1 GB/s, so a 1 TB corpus spent some 20
minutes before step 1), while a damaged file is still refused, in one line, before any of
its tokens is trained on. Why not in the background: a background hash could report the
damage after the damaged tokens were trained on. `moetrain data verify DIR` hashes
everything at once (`verify_directory`). The reader memory-maps the
token files and keeps in RAM only the per-document offsets (O(documents), never O(tokens)).
This module does not tokenize or read text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetrain.data.tokenizer import Tokenizer, tokenizer_file
from moetrain.durable import file_sha256, fsync_dir, write_atomically, write_json_atomically
from moetrain.errors import ConfigError

FORMAT = "moetrain-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "heldout")
# Read files in 8 MiB pieces to hash them: never mapped, so verifying does not add to the resident set.


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def tokenizer_identity(spec: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """What makes two tokenizers the same: the file's sha256 (or 'byte') and the special and vocabulary sizes."""
    path = tokenizer_file(spec)
    digest = "byte" if path is None else hashlib.sha256(path.read_bytes()).hexdigest()
    return {"sha256": digest, "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id}


def shard_stem(split: str, index: int) -> str:
    return f"{split}/shard_{index:05d}"


def write_shard(root: Path, split: str, index: int, tokens: np.ndarray, offsets: np.ndarray,
                extra: dict[str, Any], mask: np.ndarray | None = None) -> dict[str, Any]:
    """Write one finished shard (token file, offsets file, the loss mask if any, then its entry); return the entry."""
    stem = shard_stem(split, index)
    (root / split).mkdir(parents=True, exist_ok=True)
    files = {"tokens": f"{stem}.tokens.npy", "offsets": f"{stem}.offsets.npy"}
    arrays = [("tokens", tokens), ("offsets", offsets.astype(np.int64))]
    if mask is not None:
        files["mask"] = f"{stem}.mask.npy"
        arrays.append(("mask", mask.astype(np.uint8)))
    for key, array in arrays:
        write_atomically(root / files[key], lambda handle, a=array: np.save(handle, a, allow_pickle=False),
                         sync_dir=False)
    fsync_dir(root / split)  # both renames are durable before the entry that declares the shard finished
    entry = {"split": split, "index": index, "files": files, "dtype": str(tokens.dtype),
             "n_tokens": int(tokens.size), "n_documents": int(offsets.size - 1),
             **({"n_loss_tokens": int(mask.sum(dtype=np.int64))} if mask is not None else {}),
             "sha256": {key: file_sha256(root / name) for key, name in files.items()}, **extra}
    write_json_atomically(root / f"{stem}.json", entry)
    return entry


def write_manifest(root: Path, tokenizer_spec: str, identity: dict[str, Any], dtype: np.dtype,
                   heldout_fraction: float, entries: list[dict[str, Any]], **about: Any) -> dict[str, Any]:
    """Write manifest.json (last, atomically) from the finished shards' entries; return it."""
    manifest: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "tokenizer": {"spec": tokenizer_spec, **identity}, "dtype": str(dtype),
        "heldout_fraction": heldout_fraction, **about,
        "splits": {split: sorted(({k: v for k, v in e.items() if k != "plan"} for e in entries if e["split"] == split),
                                 key=lambda e: e["index"]) for split in SPLITS},
    }
    for split in SPLITS:
        manifest[f"{split}_tokens"] = sum(e["n_tokens"] for e in manifest["splits"][split])
        manifest[f"{split}_documents"] = sum(e["n_documents"] for e in manifest["splits"][split])
    write_json_atomically(root / MANIFEST, manifest)
    return manifest


def read_shard_entry(path: Path) -> dict[str, Any] | None:
    """A finished shard's entry, or None when there is none (the shard never finished)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError(f"shard entry {path} is not valid JSON; remove it and run `moetrain data prepare` "
                          "again") from None


def npy_layout(path: Path) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, header bytes) of a .npy file, read from its header only (no pickle, no mapping)."""
    try:
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
            else:
                raise ValueError(f"unsupported .npy version {version}")
            header = handle.tell()
    except FileNotFoundError:
        raise ConfigError(f"shard file {path} is missing; run `moetrain data prepare` again") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"shard file {path} is not a .npy array ({err})") from None
    if fortran or dtype.hasobject:
        raise ConfigError(f"shard file {path} is not a plain C-order numeric array")
    return dtype, shape, header


@dataclass(frozen=True)
class Shard:
    tokens: np.memmap
    offsets: np.ndarray
    mask: np.memmap | None = None  # conversations: uint8 per token, 1 on the targets to learn
    # The deferred sha256 checks of the token and mask files (None: checked already, or not at all).
    check_tokens: Callable[[], None] | None = None
    check_mask: Callable[[], None] | None = None


def _check_sha256(path: Path, sha256: str, root: Path) -> None:
    if file_sha256(path) != sha256:
        raise ConfigError(f"shard file {path} fails its sha256 check against {root / MANIFEST}; "
                          "it was changed or damaged: prepare the directory again")


def _open_file(root: Path, name: str, dtype: str, length: int, sha256: str, verify: bool) -> tuple[Path, int]:
    """Check one shard file's dtype, length, size and (when `verify`) checksum; return (path, header bytes)."""
    path = root / name
    found_dtype, shape, header = npy_layout(path)
    if found_dtype != np.dtype(dtype):
        raise ConfigError(f"shard file {path} holds {found_dtype} values but the manifest says {dtype}; "
                          "prepare the directory again")
    if shape != (length,):
        raise ConfigError(f"shard file {path} has shape {shape} but the manifest says ({length},)")
    expected = header + length * found_dtype.itemsize
    size = path.stat().st_size
    if size != expected:
        raise ConfigError(f"shard file {path} is {'truncated' if size < expected else 'too long'}: {size} bytes, "
                          f"expected {expected}; prepare the directory again")
    if verify:
        _check_sha256(path, sha256, root)
    return path, header


def _open_shard(root: Path, entry: dict[str, Any], dtype: str, verify: bool, hash_on_first_read: bool) -> Shard:
    files, sums = entry["files"], entry["sha256"]
    now = verify and not hash_on_first_read
    tokens_path, tokens_header = _open_file(root, files["tokens"], dtype, entry["n_tokens"], sums["tokens"], now)
    offsets_path, _ = _open_file(root, files["offsets"], "int64", entry["n_documents"] + 1, sums["offsets"],
                                 verify)
    offsets = np.load(offsets_path, allow_pickle=False)
    if offsets[0] != 0 or offsets[-1] != entry["n_tokens"] or np.any(np.diff(offsets) < 2):
        raise ConfigError(f"shard file {offsets_path} has document offsets that do not fit its token file")
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r", offset=tokens_header, shape=(entry["n_tokens"],))
    mask = None
    if "mask" in files:
        mask_path, mask_header = _open_file(root, files["mask"], "uint8", entry["n_tokens"], sums["mask"], now)
        mask = np.memmap(mask_path, dtype=np.uint8, mode="r", offset=mask_header, shape=(entry["n_tokens"],))
    if not (verify and hash_on_first_read):
        return Shard(tokens, offsets, mask)
    return Shard(tokens, offsets, mask, check_tokens=lambda: _check_sha256(tokens_path, sums["tokens"], root),
                 check_mask=(lambda: _check_sha256(root / files["mask"], sums["mask"], root)) if mask is not None
                 else None)


@dataclass(frozen=True)
class TokenShards:
    """A verified prepared directory: per split, its memory-mapped shards."""

    root: Path
    manifest: dict[str, Any]
    shards: dict[str, list[Shard]]

    def n_documents(self, split: str) -> int:
        return sum(s.offsets.size - 1 for s in self.shards[split])

    def byte_histogram(self, split: str) -> dict[int, int]:
        """UTF-8 byte counts of the split's text, summed over shards (for the unigram entropy)."""
        totals = np.zeros(256, dtype=np.int64)
        for entry in self.manifest["splits"][split]:
            totals += np.asarray(entry["byte_histogram"], dtype=np.int64)
        return {b: int(c) for b, c in enumerate(totals) if c}


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not root.is_dir():
        raise ConfigError(f"data.path = {str(root)!r} is not a directory (data.source = 'tokens')")
    if not path.is_file():
        raise ConfigError(f"{path} is missing: {root} is not a finished `moetrain data prepare` output")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError(f"{path} is not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ConfigError(f"{path} is not a {FORMAT} version {VERSION} manifest")
    return manifest


def open_token_shards(root: Path, tokenizer_spec: str, tokenizer: Tokenizer, verify: bool = True,
                      hash_on_first_read: bool = False) -> TokenShards:
    """Check and memory-map a prepared directory for `tokenizer` (raises a one-line ConfigError naming the file).

    `hash_on_first_read`: the token and mask files' sha256 is checked when each is first read
    (through the shard's `check_tokens` / `check_mask`), not now; offsets files are hashed now."""
    manifest = read_manifest(root)
    path = root / MANIFEST
    want = tokenizer_identity(tokenizer_spec, tokenizer)
    have = manifest["tokenizer"]
    if {k: have.get(k) for k in want} != want:
        differing = ", ".join(f"{k} {have.get(k)!r} vs {want[k]!r}" for k in want if have.get(k) != want[k])
        raise ConfigError(f"{path} was prepared with tokenizer {have.get('spec')!r}, not data.tokenizer = "
                          f"{tokenizer_spec!r} ({differing}); prepare the data with this tokenizer")
    dtype = manifest["dtype"]
    if np.dtype(dtype) != token_dtype(tokenizer.vocab_size):
        raise ConfigError(f"{path} says dtype {dtype}, but vocabulary {tokenizer.vocab_size} needs "
                          f"{token_dtype(tokenizer.vocab_size)}")
    shards = {split: [_open_shard(root, entry, dtype, verify, hash_on_first_read)
                      for entry in manifest["splits"][split]]
              for split in SPLITS}
    if not shards["train"]:
        raise ConfigError(f"{path} lists no training shards")
    return TokenShards(root, manifest, shards)


def verify_directory(root: Path) -> dict[str, int]:
    """`moetrain data verify`: every shard file of a prepared directory against its manifest (size, header,
    sha256); a one-line ConfigError at the first damaged file. Returns {"files", "bytes"} checked."""
    manifest = read_manifest(root)
    files = n_bytes = 0
    for split in SPLITS:
        for entry in manifest["splits"][split]:
            shard = _open_shard(root, entry, manifest["dtype"], verify=True, hash_on_first_read=False)
            del shard
            files += len(entry["files"])
            n_bytes += sum((root / name).stat().st_size for name in entry["files"].values())
    return {"files": files, "bytes": n_bytes}
