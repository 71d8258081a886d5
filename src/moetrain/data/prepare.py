"""`moetrain data prepare`: tokenize text into token shards (moetrain.data.shards), in parallel worker processes.

Inputs (any mix, each --input one of):
- `stdlib`: the embedded corpus (the running interpreter's standard library, as data.source = 'stdlib');
- a directory: its files matching --glob, one document per file (as data.source = 'dir'), or a
  Hugging Face dataset saved with `save_to_disk` (one document per row of --text-field);
- a `.jsonl` file: one document per line, the --text-field key (as data.source = 'jsonl');
- a `.parquet`, `.json` or `.arrow` file: one document per row, read with `datasets.load_dataset`
  on the local file (nothing is downloaded; the `hf` extra);
- `hf:NAME`: a dataset already in the local Hugging Face cache, one document per row of --hf-split
  (--hf-config), reloaded by `datasets` offline (HF_HUB_OFFLINE): nothing is downloaded, and a
  dataset that is not cached is one line naming it;
- any other file: one document.

--streaming reads .json / .arrow files as an IterableDataset (`load_dataset(..., streaming=True)`),
.parquet files a batch at a time with pyarrow's `ParquetFile.iter_batches` (with that IterableDataset's
features; `_parquet_tables` says why not through it), and plans and writes the shards as the records
pass (`streamed_records`, `streamed_shards`): no reference per document, no copy of the input, memory
bounded by a batch of rows, the open shards and the jobs queued. Its shards are byte-identical to the map-style
path's (the same names, split, cut and plan keys). Not the default: the map-style path plans
everything, and refuses any foreign shard, before writing, and its workers read their rows in
parallel.

With --format chat every record (a .jsonl line or a row) holds a conversation, an OpenAI-style
list of messages under --messages-field, rendered with the tokenizer directory's chat template
and masked to the assistant's tokens (moetrain.data.chat); each shard then carries a loss mask
beside its tokens, the conversation is framed only by its template (no BOS/EOS added), and the
manifest records the template's sha256. A conversation that cannot be used (no assistant turn,
an unknown role, a template that raises, no messages field) is refused in one line naming the
file and line (or row), or skipped and counted with --skip-bad-files. A refused prepare writes
no manifest, so nothing can train on it; the shards it finished are complete files, kept for
the rerun.

Documents are named as the matching data.source names them (a path relative to the input,
`FILE:LINE`, a row number; with several inputs the input's index is prefixed), sorted by
name and split into train and held-out by the hash of the name (moetrain.data.corpus.is_heldout),
so a document's side depends only on its own name and the split equals the one the
trainer makes from text. Prepare makes the split, not the trainer, because then each
split's shards are one contiguous stream on disk (a window is one or two slices of a
memory map, no per-document gather) and the held-out byte statistics are measured once
here, where the text is at hand.

Each split is cut into shards of about --shard-mb of text, a plan that depends only on
the inputs and options (not on --workers), and every shard is a job for the worker pool.
A rerun skips every shard whose entry exists with the same plan key, so an interrupted
prepare continues where it stopped; a shard of another plan in the output directory is an
error, never overwritten. manifest.json is written last. Only a list of document
references (O(documents); none with --streaming) and one shard's tokens per worker are held in memory.

--out must be a new or empty directory, or one that holds nothing but a prepare's own files
(manifest.json of this format, train/ and heldout/ shard files): anything else (a checkpoint's
manifest.json, the user's files, an input directory) is refused in one line before anything is
written. A write that fails (disk full, read-only or unwritable directory) is one line naming
the path; what was finished stays, and a rerun continues from it.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import hashlib
import json
import math
import multiprocessing
import os
import re
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tqdm

from moetrain.args import parse_typed_args
from moetrain.data.chat import ChatTemplate, ConversationError, encode_conversation, load_chat_template
from moetrain.data.corpus import files_under, is_heldout, stdlib_files, utf8_name
from moetrain.data.shards import FORMAT as SHARDS_FORMAT
from moetrain.data.shards import (
    MANIFEST,
    SPLITS,
    read_shard_entry,
    shard_stem,
    token_dtype,
    tokenizer_identity,
    verify_directory,
    write_manifest,
    write_shard,
)
from moetrain.data.tokenizer import Tokenizer, build_tokenizer, frames_with_bos
from moetrain.errors import ConfigError
from moetrain.logging import get_logger, setup_logging

log = get_logger("data")


@dataclass
class PrepareArgs:
    """Tokenize text into memory-mappable token shards for data.source = 'tokens'."""

    # Text to prepare: `stdlib`, directories, .jsonl files, text files, or save_to_disk datasets.
    input: list[str]
    # Output directory (created; a rerun continues an interrupted prepare of the same inputs).
    out: str
    # 'byte' or a Hugging Face tokenizers JSON file / a model directory holding tokenizer.json.
    tokenizer: str = "byte"
    # Worker processes tokenizing shards in parallel.
    workers: int = 1
    # Text per shard, in MB (1e6 bytes): the unit of parallel work and of a finished, never rewritten file.
    shard_mb: float = 64.0
    # Files of a directory input that are documents.
    glob: str = "**/*"
    # The JSON key holding a document's text (.jsonl and dataset inputs).
    text_field: str = "text"
    # Fraction of documents held out, chosen per document by a hash of its name (as data.heldout_fraction).
    heldout_fraction: float = 0.05
    # Skip unreadable or non-UTF-8 files (with a warning) instead of stopping; with --format chat, also
    # conversations that cannot be used (counted in the manifest's 'skipped_documents').
    skip_bad_files: bool = False
    # 'text': documents framed [BOS] text [EOS]; 'chat': conversations rendered with the chat template, loss
    # on the assistant's tokens only.
    format: str = "text"
    # Text documents: 'bos_eos' = [BOS] text [EOS]; 'tokenizer' = BOS only where the tokenizer adds one (as
    # data.framing).
    framing: str = "bos_eos"
    # --format chat: the field of a record holding its list of {"role", "content"} messages.
    messages_field: str = "messages"
    # --format chat: a Jinja chat template file used instead of the tokenizer directory's (train with the same
    # --data.chat-template).
    chat_template: str | None = None
    # Read .parquet / .json / .arrow inputs with `datasets.load_dataset(..., streaming=True)` and write each shard
    # as its records stream by: memory bounded by a few shards, not the input (for inputs larger than RAM or
    # disk). The shards are byte-identical to a prepare without it; .jsonl, text, saved and hf: inputs are read
    # as without it, a reference per document made as it is reached instead of all of them first.
    streaming: bool = False
    # hf:NAME inputs: the configuration (subset) of the cached dataset (the only one cached when not given).
    hf_config: str | None = None
    # hf:NAME inputs: the split to read.
    hf_split: str = "train"
    # No progress bar.
    quiet: bool = False


@dataclass(frozen=True)
class DocRef:
    """Where one document's text is: a whole file, a line of a .jsonl file (byte range) or a dataset row."""

    name: str
    kind: str  # "file" | "line" | "row"
    path: str
    start: int = 0
    length: int = 0  # bytes (an estimate for rows), for cutting shards


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def _jsonl_refs(path: Path, prefix: str) -> Iterator[DocRef]:
    position = 0
    with open(path, "rb") as handle:
        for line_no, line in enumerate(handle, start=1):
            if line.strip():
                yield DocRef(f"{prefix}{path.name}:{line_no:09d}", "line", str(path), position, len(line))
            position += len(line)


# File suffixes read as datasets (a row per document) and the `datasets.load_dataset` builder for each.
DATASET_FILES = {".parquet": "parquet", ".json": "json", ".arrow": "arrow"}


# An input naming a dataset in the local Hugging Face cache (`hf:NAME`), read offline.
HF_PREFIX = "hf:"


def _row_bytes(path: str, n_rows: int, dataset: Any = None) -> int:
    """The size estimate of one row (the input's bytes over its rows), for cutting shards: a function of the
    input alone, so a streaming prepare (which knows the rows only as they pass) cuts where this one does."""
    if path.startswith(HF_PREFIX):  # the Arrow files of the cache entry
        data_bytes = sum(os.path.getsize(f["filename"]) for f in dataset.cache_files)
    else:
        data_bytes = Path(path).stat().st_size if Path(path).is_file() else sum(
            f.stat().st_size for f in Path(path).rglob("*.arrow"))
    return max(1, data_bytes // max(1, n_rows))


def _dataset_refs(path: str, text_field: str, prefix: str, hf: tuple[str | None, str]) -> Iterator[DocRef]:
    path = path if path.startswith(HF_PREFIX) else str(Path(path))  # the name the plan always had
    dataset = _load_dataset(path, text_field, hf)
    per_row = _row_bytes(path, len(dataset), dataset)
    return (DocRef(f"{prefix}{i:012d}", "row", path, i, per_row) for i in range(len(dataset)))


def _is_row_input(spec: str) -> bool:
    path = Path(spec)
    return spec.startswith(HF_PREFIX) or (path.is_dir() and _is_saved_dataset(path)) or (
        path.is_file() and path.suffix in DATASET_FILES)


def _input_refs(spec: str, prefix: str, glob: str, text_field: str, skip_bad: bool,
                hf: tuple[str | None, str]) -> Iterator[DocRef]:
    """One input's documents: rows and .jsonl lines in their order (so by name), files in any order."""
    if spec.startswith(HF_PREFIX) or _is_row_input(spec):
        return _dataset_refs(spec, text_field, prefix, hf)
    if spec == "stdlib":
        root, files = stdlib_files()
    else:
        path = Path(spec)
        if path.is_file() and path.suffix == ".jsonl":
            return _jsonl_refs(path, prefix)
        if path.is_file():
            root, files = path.parent, [path]
        elif path.is_dir():
            root, files = path, files_under(path, glob)
        else:
            raise ConfigError(f"--input {spec!r} is neither a file, a directory nor 'stdlib'")
    return (DocRef(prefix + f.relative_to(root).as_posix(), "file", str(f), 0, f.stat().st_size) for f in files
            if utf8_name(f.relative_to(root).as_posix(), skip_bad))


def document_refs(inputs: list[str], glob: str, text_field: str, skip_bad: bool = False,
                  hf: tuple[str | None, str] = (None, "train")) -> list[DocRef]:
    """Every input's documents, sorted by name (file names that are not UTF-8: an error, or skipped)."""
    refs: list[DocRef] = []
    for index, spec in enumerate(inputs):
        refs += _input_refs(spec, f"{index}:" if len(inputs) > 1 else "", glob, text_field, skip_bad, hf)
    if not refs:
        raise ConfigError(f"--input {' '.join(inputs)} holds no documents")
    return sorted(refs, key=lambda r: r.name)


def _json_array(path: Path) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


# --streaming Parquet: rows per Arrow batch, and the read buffer through which a row group's pages are read (so a
# file of one huge row group is read a page at a time, not a column chunk at a time).
PARQUET_BATCH_ROWS = 1024
PARQUET_BUFFER_BYTES = 1 << 20


def _parquet_tables(path: Path, field: str, arrow_schema: Any) -> Iterator[Any]:
    """The `field` column of a Parquet file as Arrow tables of PARQUET_BATCH_ROWS rows, cast to `arrow_schema` (the
    features `datasets` casts every batch to), read synchronously by `pyarrow.parquet.ParquetFile.iter_batches`.

    Not `datasets`' streaming Parquet builder: it scans with `pyarrow.dataset` `Fragment.to_batches`, whose
    background reader runs ahead of a slower consumer without bound (batch_readahead=0 notwithstanding; apache/
    arrow#39808): while the shards were tokenized it held Arrow buffers of most of the file (pyarrow's
    allocated bytes peaked at 50 MiB of a 64 MB input, 12 MiB of a 16 MB one), the growth of peak memory with the
    input that --streaming was meant to remove. iter_batches reads a batch only when asked."""
    import pyarrow
    import pyarrow.parquet
    from datasets.table import table_cast

    reader = pyarrow.parquet.ParquetFile(path, pre_buffer=False, buffer_size=PARQUET_BUFFER_BYTES)
    for batch in reader.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field], use_threads=False):
        table = pyarrow.Table.from_batches([batch])
        yield table if arrow_schema is None else table_cast(table, arrow_schema)


def _streamed_rows(path: Path, field: str, prefix: str) -> Iterator[tuple[DocRef, Any]]:
    """(reference, value) of each row of a .parquet / .json / .arrow file, a batch of rows in memory at a time:
    JSON Lines and Arrow through `datasets.load_dataset(..., streaming=True)` (an IterableDataset), Parquet through
    `_parquet_tables` with the features that IterableDataset has. The references are those the map-style path
    makes (row index; the input's bytes over its rows), so the plan and the shards are the same."""
    if path.suffix == ".json" and _json_array(path):
        raise ConfigError(f"--streaming: {path} is one JSON array, which `datasets` reads whole into memory; "
                          "write it as JSON Lines (an object per line) or Parquet, or prepare without --streaming")
    stream = _load_dataset(str(path), field, streaming=True).select_columns([field])
    features = stream.features
    if path.suffix == ".parquet":  # the footer's row count: nothing read twice
        import pyarrow.parquet

        n_rows = pyarrow.parquet.ParquetFile(path).metadata.num_rows
        tables = _parquet_tables(path, field, None if features is None else features.arrow_schema)
    else:  # a first pass, as Arrow tables (no Python objects), to count the rows the shard plan divides by
        n_rows = sum(table.num_rows for table in stream.with_format("arrow").iter(batch_size=1024))
        tables = stream.with_format("arrow").iter(batch_size=1024)
    per_row = _row_bytes(str(path), n_rows)
    import pyarrow

    pool = pyarrow.default_memory_pool()
    index = -1
    # Each column turned into Python values as the map-style Dataset's rows are (to_pylist, then the features' own
    # decoding: `datasets` stores lists of objects whose keys differ from row to row as JSON strings, decoded on
    # the way out), and the memory of each batch handed back: Arrow's default pool (mimalloc) keeps it otherwise.
    for table in tables:
        values = table.column(field).to_pylist()
        for value in features.decode_column(values, field) if features is not None else values:
            index += 1
            yield DocRef(f"{prefix}{index:012d}", "row", str(path), index, per_row), value
        del table, values
        pool.release_unused()
    if index + 1 != n_rows:
        raise ConfigError(f"--input {str(path)!r} held {n_rows} rows when counted and {index + 1} when read: "
                          "it changed during the prepare; run it again")


def streamed_records(inputs: list[str], glob: str, field: str, skip_bad: bool,
                     hf: tuple[str | None, str]) -> Iterator[tuple[DocRef, Any]]:
    """--streaming: every input's documents in name order (the order `document_refs` sorts them into), each
    with its value where it was read from a stream (else _UNREAD: a worker reads it from the reference), made
    as they are reached: no list of all documents, no copy of an input."""
    prefixes = [f"{index}:" if len(inputs) > 1 else "" for index in range(len(inputs))]
    last = None
    for index in sorted(range(len(inputs)), key=lambda i: prefixes[i]):  # names of input i all start prefixes[i]
        spec, path = inputs[index], Path(inputs[index])
        if not spec.startswith(HF_PREFIX) and path.is_file() and path.suffix in DATASET_FILES:
            records: Iterator[tuple[DocRef, Any]] = _streamed_rows(path, field, prefixes[index])
        else:  # .jsonl lines by byte range, memory-mapped Arrow rows by index, files by name
            refs = _input_refs(spec, prefixes[index], glob, field, skip_bad, hf)
            if not (spec.startswith(HF_PREFIX) or _is_row_input(spec) or path.suffix == ".jsonl"):
                refs = iter(sorted(refs, key=lambda r: r.name))
            records = ((ref, _UNREAD) for ref in refs)
        for ref, value in records:
            if last is not None and ref.name <= last:
                raise ConfigError(f"--streaming: document {ref.name!r} comes after {last!r} in --input {spec!r}, "
                                  "not in name order; prepare without --streaming")
            last = ref.name
            yield ref, value


class PackedShard:
    """The records of one shard being gathered by a streaming prepare (references and the values that streamed
    in with them), and its plan key so far. Held in memory only; it reaches a worker as a job argument."""

    def __init__(self, seed: bytes):
        self.seed, self.digest = seed, hashlib.sha256(seed)
        self.refs: list[DocRef] = []
        self.values: list[Any] = []
        self.bytes = 0

    @property
    def count(self) -> int:
        return len(self.refs)

    def add(self, ref: DocRef, value: Any) -> None:
        self.digest.update(_plan_line(ref))
        self.refs.append(ref)
        self.values.append(value)
        self.bytes += ref.length

    def plan_key(self) -> str:
        return self.digest.hexdigest()

    def __getstate__(self) -> dict[str, Any]:  # to a worker: the records (a hash object does not pickle)
        return {k: v for k, v in self.__dict__.items() if k != "digest"}

    def records(self) -> tuple[list[DocRef], list[Any]]:
        """(references, values: _UNREAD where the worker reads the record itself)."""
        return list(self.refs), list(self.values)

    def pop(self) -> tuple[DocRef, Any]:
        """Take the last record out (the plan key is recomputed from the rest)."""
        ref, value = self.refs.pop(), self.values.pop()
        self.bytes -= ref.length
        self.digest = hashlib.sha256(self.seed)
        for kept in self.refs:
            self.digest.update(_plan_line(kept))
        return ref, value


def streamed_shards(records: Iterator[tuple[DocRef, Any]], heldout_fraction: float, shard_bytes: int,
                    seed: bytes) -> Iterator[tuple[str, int, PackedShard]]:
    """(split, index, records) of each shard as soon as it is complete: `split_refs` then `cut_shards` done
    in one pass, holding one open shard per split (a shard closes when the next document of its split finds
    it full, or at the end, where the tiny-corpus rule can still move the last training document to the
    held-out split). `seed` starts each shard's plan key (`plan_seed`)."""
    open_shards = {split: PackedShard(seed) for split in SPLITS}
    count, seen = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
    for ref, value in records:
        split = "heldout" if is_heldout(ref.name, heldout_fraction) else "train"
        if open_shards[split].count and open_shards[split].bytes >= shard_bytes:
            yield split, count[split], open_shards[split]
            count[split] += 1
            open_shards[split] = PackedShard(seed)
        open_shards[split].add(ref, value)
        seen[split] += 1
    if not seen["train"] and not seen["heldout"]:
        raise ConfigError("--input holds no documents")
    if heldout_fraction > 0 and not seen["heldout"]:  # as split_refs: hold out the last document
        open_shards["heldout"].add(*open_shards["train"].pop())
        seen["train"] -= 1
        seen["heldout"] = 1
    if not seen["train"]:
        raise ConfigError(f"--heldout-fraction {heldout_fraction} leaves no training documents out of "
                          f"{seen['heldout']}")
    for split in SPLITS:
        if open_shards[split].count:
            yield split, count[split], open_shards[split]


def split_refs(refs: list[DocRef], heldout_fraction: float) -> dict[str, list[DocRef]]:
    """Train / held-out by name hash, with the trainer's rule for tiny corpora (hold out the last document)."""
    heldout = [r for r in refs if is_heldout(r.name, heldout_fraction)]
    train = [r for r in refs if not is_heldout(r.name, heldout_fraction)]
    if heldout_fraction > 0 and not heldout:
        heldout, train = train[-1:], train[:-1]
    if not train:
        raise ConfigError(f"--heldout-fraction {heldout_fraction} leaves no training documents out of {len(refs)}")
    return {"train": train, "heldout": heldout}


def cut_shards(refs: list[DocRef], shard_bytes: int) -> list[list[DocRef]]:
    shards: list[list[DocRef]] = []
    size = 0
    for ref in refs:
        if not shards or size >= shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(ref)
        size += ref.length
    return shards


def plan_seed(identity: dict[str, Any], options: dict[str, Any]) -> bytes:
    return json.dumps([identity, options], sort_keys=True).encode()


def _plan_line(ref: DocRef) -> bytes:
    return f"{ref.name}\0{ref.kind}\0{ref.path}\0{ref.start}\0{ref.length}\n".encode()


def plan_key(refs: list[DocRef], identity: dict[str, Any], options: dict[str, Any]) -> str:
    """What decides a shard's contents: its documents (names, places, sizes), the tokenizer and the text options."""
    digest = hashlib.sha256(plan_seed(identity, options))
    for ref in refs:
        digest.update(_plan_line(ref))
    return digest.hexdigest()


# Per worker process: the tokenizers (each built once) and open datasets, by spec and path.
_WORKER: dict[str, Any] = {}


def _import_datasets(path: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"--input {path!r} is read with the `datasets` package; install "
                          "the extra `pip install moetrain[hf]`") from None
    return datasets


@contextmanager
def _hub_offline(datasets: Any) -> Iterator[None]:
    """Offline for the Hub, as HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1 make it: `datasets` then resolves a
    name from its local cache and downloads nothing (it checks this flag before any request). The variables
    are read when `datasets` is imported, so in a process that imported it before, its parsed flag is set
    for the duration instead."""
    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


def _load_cached(path: str, hf: tuple[str | None, str], streaming: bool = False) -> Any:
    """`hf:NAME`: the dataset of that name in the local Hugging Face cache (HF_HOME / HF_DATASETS_CACHE),
    reloaded offline by `datasets.load_dataset(NAME, CONFIG, split=SPLIT)` as it reloads any cached dataset."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # (for a `datasets` imported from here on)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    datasets = _import_datasets(path)
    name, (config, split) = path[len(HF_PREFIX):], hf
    where = f"--input {path!r}" + (f" (--hf-config {config!r})" if config else "") + f" --hf-split {split!r}"
    if not name or Path(name).exists():
        raise ConfigError(f"{where}: {'no dataset name given' if not name else repr(name) + ' is also a local path'}"
                          "; give hf:NAME of a dataset in the local Hugging Face cache, or the local path itself")
    try:
        with _hub_offline(datasets):
            return datasets.load_dataset(name, config, split=split, streaming=streaming)
    except ConnectionError:  # offline and not cached: what `datasets` raises after looking in the cache
        raise ConfigError(f"{where}: dataset {name!r} is not in the local Hugging Face cache "
                          f"({datasets.config.HF_DATASETS_CACHE}); nothing is downloaded: load it once with "
                          "network access (or set HF_HOME / HF_DATASETS_CACHE to where it is)") from None
    except Exception as err:  # noqa: BLE001 - a wrong config or split, a damaged cache entry: many types
        lines = "; ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
        raise ConfigError(f"{where}: dataset {name!r} cannot be read from the local Hugging Face cache "
                          f"({type(err).__name__}: {lines})") from None


def _load_dataset(path: str, text_field: str, hf: tuple[str | None, str] = (None, "train"),
                  streaming: bool = False) -> Any:
    """The dataset of a row input (map-style, memory-mapped Arrow; an IterableDataset when `streaming`),
    checked to hold `text_field`."""
    if path.startswith(HF_PREFIX):
        dataset = _load_cached(path, hf, streaming)
        if text_field not in (dataset.column_names or []):
            raise ConfigError(f"--text-field / --messages-field {text_field!r} is not a column of {path!r} "
                              f"(columns: {dataset.column_names})")
        return dataset
    datasets = _import_datasets(path)
    suffix = Path(path).suffix
    try:
        if streaming and Path(path).is_file() and suffix in DATASET_FILES:
            options: dict[str, Any] = {}
            if suffix == ".parquet":  # no pre-buffering: it keeps each file's column chunks read so far
                import pyarrow.dataset

                options["fragment_scan_options"] = pyarrow.dataset.ParquetFragmentScanOptions(pre_buffer=False)
            dataset = datasets.load_dataset(DATASET_FILES[suffix], data_files=str(path), split="train",
                                            streaming=True, **options)
        elif Path(path).is_file() and suffix in DATASET_FILES:
            dataset = datasets.load_dataset(DATASET_FILES[suffix], data_files=str(path), split="train")
        else:
            dataset = datasets.load_from_disk(path)
    except Exception as err:  # noqa: BLE001 - datasets raises many unrelated types for an unreadable file
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"--input {path!r} is not a readable dataset ({type(err).__name__}: {first})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ConfigError(f"--input {path!r} is a DatasetDict without a 'train' split")
        dataset = dataset["train"]
    if dataset.column_names is not None and text_field not in dataset.column_names:
        raise ConfigError(f"--text-field / --messages-field {text_field!r} is not a column of {path!r} "
                          f"(columns: {dataset.column_names})")
    return dataset


class _Unread(enum.Enum):
    """A record's value not read yet (the worker reads it from its DocRef), as opposed to one streamed in with
    it. An enum member, so it stays the same object when a job is sent to a worker process."""

    UNREAD = 0


_UNREAD: Any = _Unread.UNREAD


def _row_value(ref: DocRef, field: str, hf: tuple[str | None, str]) -> Any:
    key = ("dataset", ref.path)
    if key not in _WORKER:
        _WORKER[key] = _load_dataset(ref.path, field, hf)
    return _WORKER[key][ref.start][field]


def _hf_options(options: dict[str, Any]) -> tuple[str | None, str]:
    return options.get("hf_config"), options.get("hf_split", "train")


def _read_text(ref: DocRef, text_field: str, skip_bad: bool, value: Any = _UNREAD,
               hf: tuple[str | None, str] = (None, "train")) -> str | None:
    problem = ""
    try:
        if ref.kind == "row":
            value = _row_value(ref, text_field, hf) if value is _UNREAD else value
            return value if isinstance(value, str) else None
        with open(ref.path, "rb") as handle:
            handle.seek(ref.start)
            data = handle.read(ref.length) if ref.kind == "line" else handle.read()
        text = data.decode("utf-8")
        if ref.kind == "file":
            return text
        value = json.loads(text)[text_field]
        if not isinstance(value, str):
            raise TypeError(f"{text_field!r} is {type(value).__name__}, not a string")
        return value
    except OSError as err:
        problem = f"{ref.path} is unreadable ({err.strerror or type(err).__name__})"
    except UnicodeDecodeError as err:
        problem = f"{ref.path} is not UTF-8 text (bad byte at offset {ref.start + err.start})"
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        problem = f"{ref.name} is not a JSON object with a string field {text_field!r} ({type(err).__name__})"
    if skip_bad:
        log.warning("skipping %s", problem)
        return None
    raise ConfigError(f"{problem}; fix or remove it, or pass --skip-bad-files")


def _where(ref: DocRef) -> str:
    """A record's place for messages: FILE:LINE, or FILE row N."""
    if ref.kind == "line":
        return f"{ref.path}:{int(ref.name.rsplit(':', 1)[1])}"
    return f"{ref.path} row {ref.start}" if ref.kind == "row" else ref.path


def _read_messages(ref: DocRef, field: str, value: Any = _UNREAD,
                   hf: tuple[str | None, str] = (None, "train")) -> Any:
    """The --messages-field value of one record (raises ConversationError when it has none)."""
    if ref.kind == "row":
        return _row_value(ref, field, hf) if value is _UNREAD else value
    if ref.kind != "line":
        raise ConversationError("--format chat reads .jsonl, .json, .parquet, .arrow files or saved datasets, "
                                "not a whole file as one conversation")
    with open(ref.path, "rb") as handle:
        handle.seek(ref.start)
        data = handle.read(ref.length)
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConversationError(f"it is not a JSON object ({type(err).__name__})") from None
    if not isinstance(record, dict) or field not in record:
        raise ConversationError(f"it has no --messages-field {field!r}")
    return record[field]


def _chat_template(options: dict[str, Any]) -> ChatTemplate:
    key = ("chat", options["chat_template_sha256"])
    if key not in _WORKER:
        _WORKER[key] = load_chat_template(options["tokenizer"], options["chat_template"])
    return _WORKER[key]


def _prepare_chat_shard(out: str, split: str, index: int, refs: list[DocRef], options: dict[str, Any],
                        tokenizer: Tokenizer, values: list[Any]) -> dict[str, Any]:
    """Worker, --format chat: render, tokenize and mask each conversation of one shard; write it with its mask."""
    template, dtype = _chat_template(options), token_dtype(tokenizer.vocab_size)
    pieces, masks, lengths, names = [], [], [], []
    histogram = np.zeros(256, dtype=np.int64)
    skipped = 0
    for ref, value in zip(refs, values):
        try:
            messages = _read_messages(ref, options["messages_field"], value, _hf_options(options))
            ids, mask, assistant_text = encode_conversation(template, tokenizer.encode_with_offsets,  # type: ignore[attr-defined]
                                                            messages, options["messages_field"])
        except ConversationError as err:
            if not options["skip_bad_files"]:
                raise ConfigError(f"{_where(ref)}: this conversation cannot be used: {err}; fix or remove it, "
                                  "or pass --skip-bad-files to skip and count such records") from None
            log.warning("skipping %s: %s", _where(ref), err)
            skipped += 1
            continue
        if ids.size < 2:
            skipped += 1
            continue
        histogram += np.bincount(np.frombuffer(assistant_text.encode("utf-8"), dtype=np.uint8), minlength=256)
        pieces.append(ids.astype(dtype))
        masks.append(mask)
        lengths.append(ids.size)
        names.append(ref.name)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    loss_mask = np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    extra = {"plan": options["plan"], "byte_histogram": histogram.tolist(), "skipped_documents": skipped,
             "first_document": names[0] if names else None, "last_document": names[-1] if names else None}
    return write_shard(Path(out), split, index, tokens, offsets, extra, mask=loss_mask)


def _encode(tokenizer: Tokenizer, text: str) -> np.ndarray:
    if tokenizer.__class__.__name__ == "ByteTokenizer":
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)  # the byte tokenizer's ids are the bytes
    return tokenizer.encode(text).numpy()


def _prepare_shard(job: tuple[str, str, int, list[DocRef] | PackedShard, dict[str, Any]]) -> dict[str, Any]:
    """Worker: read (or take, when they streamed in with the job), tokenize and write one shard; return its entry."""
    out, split, index, shard, options = job
    refs, values = shard.records() if isinstance(shard, PackedShard) else (shard, [_UNREAD] * len(shard))
    key = ("tokenizer", options["tokenizer"])  # per spec: one process may prepare with several tokenizers
    if key not in _WORKER:
        _WORKER[key] = build_tokenizer(options["tokenizer"])
    tokenizer = _WORKER[key]
    if options.get("format") == "chat":
        return _prepare_chat_shard(out, split, index, refs, options, tokenizer, values)
    dtype = token_dtype(tokenizer.vocab_size)
    pieces, lengths, names = [], [], []
    histogram = np.zeros(256, dtype=np.int64)
    for ref, value in zip(refs, values):
        text = _read_text(ref, options["text_field"], options["skip_bad_files"], value, _hf_options(options))
        if not text:
            continue  # empty documents are dropped, as the trainer drops them
        ids = _encode(tokenizer, text)
        histogram += np.bincount(np.frombuffer(text.encode("utf-8"), dtype=np.uint8), minlength=256)
        bos = [tokenizer.bos_id] if options.get("bos", True) else []
        pieces += [np.array(bos, dtype=dtype), ids.astype(dtype), np.array([tokenizer.eos_id], dtype)]
        lengths.append(ids.size + 1 + len(bos))
        names.append(ref.name)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    extra = {"plan": options["plan"], "byte_histogram": histogram.tolist(),
             "first_document": names[0] if names else None, "last_document": names[-1] if names else None}
    return write_shard(Path(out), split, index, tokens, offsets, extra)


# What a prepare's output directory may hold: its manifest (and the temporary name it is written
# under), and per split the shard files, their entries and the temporary files of unfinished shards.
_SPLIT_FILE = re.compile(r"^(shard_\d{5,}\.(tokens\.npy|offsets\.npy|mask\.npy|json)"
                         r"|\.shard_\d{5,}\.[a-z.]+\.tmp-\d+)$")
_TOP_FILE = re.compile(rf"^({re.escape(MANIFEST)}|\.{re.escape(MANIFEST)}\.tmp-\d+)$")


def _foreign_entry(out: Path) -> str | None:
    """The first entry of an existing --out that is not a prepare's own file (one line), or None."""
    for entry in sorted(out.iterdir()):
        if entry.name in SPLITS and entry.is_dir() and not entry.is_symlink():
            for inner in sorted(entry.iterdir()):
                if not (_SPLIT_FILE.match(inner.name) and inner.is_file() and not inner.is_symlink()):
                    return f"{inner} is not a token shard file"
        elif not (_TOP_FILE.match(entry.name) and entry.is_file() and not entry.is_symlink()):
            return f"it holds {entry.name!r}, which `moetrain data prepare` does not write"
        elif entry.name == MANIFEST:
            try:
                manifest = json.loads(entry.read_bytes())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                manifest = None
            if not isinstance(manifest, dict) or manifest.get("format") != SHARDS_FORMAT:
                return f"its {MANIFEST} is not a token-shard manifest (a checkpoint's, or another tool's)"
    return None


def check_output_dir(out: Path, inputs: list[str]) -> None:
    """Refuse (one line, before anything is written) an --out that a prepare must not write into."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is not a directory; choose a new or empty directory")
    resolved = out.resolve()
    for spec in inputs:
        if spec != "stdlib" and Path(spec).is_dir() and resolved.is_relative_to(Path(spec).resolve()):
            raise ConfigError(f"--out {str(out)!r} is inside --input {spec!r}: its shards would be read as "
                              "documents; choose a directory outside the inputs")
    if out.is_dir():
        try:
            foreign = _foreign_entry(out)
        except OSError as err:
            raise ConfigError(f"--out {str(out)!r} cannot be read: {err.strerror or err}") from None
        if foreign is not None:
            raise ConfigError(f"--out {str(out)!r} already exists and is not an unfinished prepare of these "
                              f"inputs ({foreign}); choose a new or empty directory")
        if not os.access(out, os.W_OK | os.X_OK):
            raise ConfigError(f"--out {str(out)!r} is not writable by this user; choose another directory")
        return
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"--out {str(out)!r} is below {str(parent)!r}, which is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {str(out)!r} cannot be created: {str(parent)!r} is not writable by this user")


def _nearly_full(out: Path) -> bool:
    # numpy's writer reports a short write as a bare OSError without an errno (as moetrain.runtime.disk notes
    # of torch's): with under 1 MiB left on the file system, that is the disk being full.
    try:
        return shutil.disk_usage(out if out.exists() else out.absolute().parent).free < 1 << 20
    except OSError:
        return False


@contextmanager
def _writes_to(out: Path) -> Iterator[None]:
    """A failed write into --out (disk full, read-only, unwritable) as one ConfigError line naming the path."""
    try:
        yield
    except OSError as err:
        where = err.filename or out
        if err.errno in (errno.ENOSPC, errno.EDQUOT) or (err.errno is None and _nearly_full(out)):
            raise ConfigError(f"no space left on device writing --out {str(out)!r} ({where}); finished shards are "
                              "kept: free space and run the same command again to continue") from None
        raise ConfigError(f"cannot write --out {str(out)!r}: {err.strerror or type(err).__name__} ({where}); "
                          "choose a writable directory") from None


def _run_jobs(jobs: Iterable[tuple], workers: int, finished: Callable[[dict[str, Any]], None]) -> None:
    """Run each job (in `workers` processes when > 1), handing every entry to `finished`. At most 2 jobs per
    worker are queued at a time, so a streaming prepare holds a bounded number of shards' records in memory
    (a Pool's imap would draw the whole job iterator into its queue)."""
    if workers <= 1:
        for job in jobs:
            finished(_prepare_shard(job))
        return
    # fork: the workers start in milliseconds and inherit the imports; spawn would re-import torch.
    pool = multiprocessing.get_context("fork").Pool(workers)
    pending: deque[Any] = deque()
    try:
        for job in jobs:
            pending.append(pool.apply_async(_prepare_shard, (job,)))
            while pending and (len(pending) >= 2 * workers or pending[0].ready()):
                finished(pending.popleft().get())
        while pending:
            finished(pending.popleft().get())
        pool.close()
        pool.join()
    except BaseException:
        pool.terminate()
        raise


# glibc's mallopt parameter number of the mmap threshold (malloc.h).
_M_MMAP_THRESHOLD = -3


def _map_large_allocations() -> None:
    """--streaming: every allocation of 1 MiB or more gets its own memory map, returned when it is freed.

    glibc raises its mmap threshold to the size of each large block freed, so after the first, the next ones
    (datasets' JSON reader reads JSON Lines in 10 MiB chunks) come from the heap, where fragmentation kept them:
    the peak RSS of benchmarks/prepare_streaming.py grew 434 / 458 / 478 MB for 16 / 64 / 258 MB of JSON Lines,
    and was 430 / 448 / 450 MB with the threshold fixed (MALLOC_MMAP_THRESHOLD_=1048576, what this sets while the
    process runs; a fixed threshold turns the dynamic one off). Where there is no glibc mallopt, nothing is done."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, 1 << 20)


def prepare(args: PrepareArgs) -> dict[str, Any]:
    """Prepare args.input into args.out; return the manifest."""
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers} is invalid: must be >= 1")
    if not (math.isfinite(args.shard_mb) and args.shard_mb > 0) or args.shard_mb * 1e6 >= 2**63:
        raise ConfigError(f"--shard-mb {args.shard_mb} is invalid: must be a finite number > 0")
    if not 0 <= args.heldout_fraction < 1:
        raise ConfigError(f"--heldout-fraction {args.heldout_fraction} is invalid: must be in [0, 1)")
    if args.format not in ("text", "chat"):
        raise ConfigError(f"--format {args.format!r} is invalid: 'text' or 'chat'")
    check_output_dir(Path(args.out), list(args.input))
    with _writes_to(Path(args.out)):
        return _prepare(args)


def _prepare(args: PrepareArgs) -> dict[str, Any]:
    _WORKER.clear()  # tokenizers and datasets of an earlier prepare in this process may have changed on disk
    tokenizer = build_tokenizer(args.tokenizer)
    identity = tokenizer_identity(args.tokenizer, tokenizer)
    out = Path(args.out)
    chat: dict[str, Any] | None = None
    if args.format == "chat":
        if not hasattr(tokenizer, "encode_with_offsets"):
            raise ConfigError(f"--format chat needs a Hugging Face tokenizer directory, not --tokenizer "
                              f"{args.tokenizer!r}")
        template = load_chat_template(args.tokenizer, args.chat_template)
        chat = {"template_sha256": template.sha256, "messages_field": args.messages_field,
                "chat_template": args.chat_template, "generation_markers": template.has_generation_markers}
    field = args.messages_field if chat else args.text_field
    hf = (args.hf_config, args.hf_split)
    text_options: dict[str, Any] = {"text_field": args.text_field, "skip_bad_files": args.skip_bad_files}
    framing = "template" if chat else args.framing
    if not chat and not frames_with_bos(args.tokenizer, tokenizer, args.framing):
        text_options["bos"] = False  # (only then, so the plan of a bos_eos prepare stays what it was)
    if chat:  # (only then, so the plan of a text prepare, and a rerun over its shards, stays what it was)
        text_options.update(format="chat", messages_field=args.messages_field,
                            chat_template_sha256=chat["template_sha256"], chat_template=args.chat_template)
    if any(spec.startswith(HF_PREFIX) for spec in args.input):  # (only then, as above)
        text_options.update(hf_config=args.hf_config, hf_split=args.hf_split)
    shard_bytes = int(args.shard_mb * 1e6)
    entries: dict[tuple[str, int], dict[str, Any]] = {}
    planned: set[tuple[str, int]] = set()
    new_shards: list[tuple[str, int]] = []

    def job_of(split: str, index: int, shard_refs: list[DocRef] | PackedShard) -> tuple | None:
        """The job preparing this shard, or None when it is finished already (a rerun) with the same plan."""
        key = shard_refs.plan_key() if isinstance(shard_refs, PackedShard) else plan_key(shard_refs, identity,
                                                                                          text_options)
        entry_path = out / f"{shard_stem(split, index)}.json"
        entry = read_shard_entry(entry_path)
        planned.add((split, index))
        if entry is None:
            new_shards.append((split, index))
            return (str(out), split, index, shard_refs, {**text_options, "tokenizer": args.tokenizer, "plan": key})
        if entry.get("plan") != key:
            raise ConfigError(f"{entry_path} is a finished shard of other inputs or options; finished shards "
                              "are never rewritten: use another --out or remove that directory")
        entries[(split, index)] = entry
        return None

    def check_no_stale() -> None:
        for split in SPLITS:
            for stale in sorted((out / split).glob("shard_*.json")) if (out / split).is_dir() else []:
                if (split, int(stale.stem.split("_")[1])) not in planned:
                    raise ConfigError(f"{stale} is a finished shard of other inputs or options; use another "
                                      "--out or remove that directory")

    if args.streaming:  # planned as the records stream by; a foreign shard is found when its index is reached
        _map_large_allocations()
        shards = streamed_shards(streamed_records(args.input, args.glob, field, args.skip_bad_files, hf),
                                 args.heldout_fraction, shard_bytes, plan_seed(identity, text_options))
        jobs: Iterable[tuple] = (job for job in (job_of(*shard) for shard in shards) if job is not None)
        n_jobs = None
    else:  # planned whole before anything is written
        refs = document_refs(args.input, args.glob, field, args.skip_bad_files, hf)
        jobs = [job for split, split_list in split_refs(refs, args.heldout_fraction).items()
                for index, shard_refs in enumerate(cut_shards(split_list, shard_bytes))
                if (job := job_of(split, index, shard_refs)) is not None]
        check_no_stale()
        n_jobs = len(jobs)
        if entries:
            log.info("%d of %d shards already finished in %s; preparing the rest", len(entries), len(planned), out)
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:  # files cut short by an interrupted run: never complete, never renamed, only in the way
        for partial in (out / split).glob(".shard_*.tmp-*") if (out / split).is_dir() else []:
            partial.unlink()
    started = time.perf_counter()
    bar = tqdm.tqdm(total=n_jobs, unit="shard", disable=args.quiet or n_jobs == 0, dynamic_ncols=True)
    tokens_done = 0

    def finished(entry: dict[str, Any]) -> None:
        nonlocal tokens_done
        entries[(entry["split"], entry["index"])] = entry
        tokens_done += entry["n_tokens"]
        bar.update(1)
        bar.set_postfix_str(f"{tokens_done / max(time.perf_counter() - started, 1e-9) / 1e6:.2f}M tokens/s")

    try:
        _run_jobs(jobs, 1 if n_jobs is not None and n_jobs <= 1 else min(args.workers, n_jobs or args.workers),
                  finished)
    finally:
        bar.close()
    if args.streaming:
        check_no_stale()
    seconds = time.perf_counter() - started
    if chat:
        chat["skipped_documents"] = sum(e.get("skipped_documents", 0) for e in entries.values())
        chat["loss_tokens"] = {split: sum(e.get("n_loss_tokens", 0) for e in entries.values() if e["split"] == split)
                               for split in SPLITS}
    manifest = write_manifest(out, args.tokenizer, identity, token_dtype(tokenizer.vocab_size),
                              args.heldout_fraction, list(entries.values()), text_field=args.text_field,
                              inputs=list(args.input), framing=framing, **({"chat": chat} if chat else {}))
    new_tokens = sum(entries[shard]["n_tokens"] for shard in new_shards)
    if chat:
        log.info("conversations: %d + %d assistant tokens to learn from (train + held-out); %d conversations "
                 "skipped", chat["loss_tokens"]["train"], chat["loss_tokens"]["heldout"], chat["skipped_documents"])
    log.info("prepared %s: %d train + %d held-out documents, %d + %d tokens (%s), %d shards (%d new, %.1fs, "
             "%.2fM tokens/s)", out, manifest["train_documents"], manifest["heldout_documents"],
             manifest["train_tokens"], manifest["heldout_tokens"], manifest["dtype"], len(entries), len(new_shards),
             seconds, new_tokens / max(seconds, 1e-9) / 1e6)
    return manifest


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("moetrain data prepare --help: tokenize text or conversations into token shards\n"
              "moetrain data verify DIR: check every shard file's size, header and sha256 against the manifest\n")
        argv = ["prepare", "--help"]  # the full help of prepare, the command with options
    if argv[0] == "verify":  # every shard file's size, header and sha256 against the manifest, now
        if len(argv) != 2:
            raise ConfigError("usage: moetrain data verify DIR (a `moetrain data prepare` output)")
        checked = verify_directory(Path(argv[1]))
        print(f"{argv[1]}: {checked['files']} shard files ({checked['bytes'] / 1e6:.1f} MB) match the manifest")
        return 0
    if argv[0] != "prepare":
        raise ConfigError(f"unknown data command {argv[0]!r}; valid: prepare, verify")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker: --workers sets the parallelism
    args = parse_typed_args(PrepareArgs, argv[1:], prog="moetrain data prepare", bool_flags=True)
    setup_logging()
    prepare(args)
    return 0
