"""`moetrain data prepare`: tokenize text into token shards (moetrain.data.shards), in parallel worker processes.

Inputs (any mix, each --input one of):
- `stdlib`: the embedded corpus (the running interpreter's standard library, as data.source = 'stdlib');
- a directory: its files matching --glob, one document per file (as data.source = 'dir'), or a
  Hugging Face dataset saved with `save_to_disk` (one document per row of --text-field);
- a `.jsonl` file: one document per line, the --text-field key (as data.source = 'jsonl');
- a `.parquet`, `.json` or `.arrow` file: one document per row, read with `datasets.load_dataset`
  on the local file (nothing is downloaded; the `hf` extra);
- any other file: one document.

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
references (O(documents)) and one shard's tokens per worker are held in memory.

--out must be a new or empty directory, or one that holds nothing but a prepare's own files
(manifest.json of this format, train/ and heldout/ shard files): anything else (a checkpoint's
manifest.json, the user's files, an input directory) is refused in one line before anything is
written. A write that fails (disk full, read-only or unwritable directory) is one line naming
the path; what was finished stays, and a rerun continues from it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import multiprocessing
import os
import re
import shutil
import time
from collections.abc import Iterator
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


def _jsonl_refs(path: Path, prefix: str) -> list[DocRef]:
    refs, position = [], 0
    with open(path, "rb") as handle:
        for line_no, line in enumerate(handle, start=1):
            if line.strip():
                refs.append(DocRef(f"{prefix}{path.name}:{line_no:09d}", "line", str(path), position, len(line)))
            position += len(line)
    return refs


# File suffixes read as datasets (a row per document) and the `datasets.load_dataset` builder for each.
DATASET_FILES = {".parquet": "parquet", ".json": "json", ".arrow": "arrow"}


def _dataset_refs(path: Path, text_field: str, prefix: str) -> list[DocRef]:
    dataset = _load_dataset(str(path), text_field)
    data_bytes = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*.arrow"))
    per_row = max(1, data_bytes // max(1, len(dataset)))
    return [DocRef(f"{prefix}{i:012d}", "row", str(path), i, per_row) for i in range(len(dataset))]


def document_refs(inputs: list[str], glob: str, text_field: str, skip_bad: bool = False) -> list[DocRef]:
    """Every input's documents, sorted by name (file names that are not UTF-8: an error, or skipped)."""
    refs: list[DocRef] = []
    for index, spec in enumerate(inputs):
        prefix = f"{index}:" if len(inputs) > 1 else ""
        if spec == "stdlib":
            root, files = stdlib_files()
        else:
            path = Path(spec)
            if path.is_dir() and _is_saved_dataset(path):
                refs += _dataset_refs(path, text_field, prefix)
                continue
            if path.is_file() and path.suffix in DATASET_FILES:
                refs += _dataset_refs(path, text_field, prefix)
                continue
            if path.is_file() and path.suffix == ".jsonl":
                refs += _jsonl_refs(path, prefix)
                continue
            if path.is_file():
                root, files = path.parent, [path]
            elif path.is_dir():
                root, files = path, files_under(path, glob)
            else:
                raise ConfigError(f"--input {spec!r} is neither a file, a directory nor 'stdlib'")
        refs += [DocRef(prefix + f.relative_to(root).as_posix(), "file", str(f), 0, f.stat().st_size) for f in files
                 if utf8_name(f.relative_to(root).as_posix(), skip_bad)]
    if not refs:
        raise ConfigError(f"--input {' '.join(inputs)} holds no documents")
    return sorted(refs, key=lambda r: r.name)


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


def plan_key(refs: list[DocRef], identity: dict[str, Any], options: dict[str, Any]) -> str:
    """What decides a shard's contents: its documents (names, places, sizes), the tokenizer and the text options."""
    digest = hashlib.sha256(json.dumps([identity, options], sort_keys=True).encode())
    for ref in refs:
        digest.update(f"{ref.name}\0{ref.kind}\0{ref.path}\0{ref.start}\0{ref.length}\n".encode())
    return digest.hexdigest()


# Per worker process: the tokenizers (each built once) and open datasets, by spec and path.
_WORKER: dict[str, Any] = {}


def _load_dataset(path: str, text_field: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"--input {path!r} is a saved dataset, which needs the `datasets` package; install "
                          "the extra `pip install moetrain[hf]`") from None
    suffix = Path(path).suffix
    try:
        if Path(path).is_file() and suffix in DATASET_FILES:
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
    if text_field not in dataset.column_names:
        raise ConfigError(f"--text-field / --messages-field {text_field!r} is not a column of {path!r} "
                          f"(columns: {dataset.column_names})")
    return dataset


def _read_text(ref: DocRef, text_field: str, skip_bad: bool) -> str | None:
    problem = ""
    try:
        if ref.kind == "row":
            key = ("dataset", ref.path)
            if key not in _WORKER:
                _WORKER[key] = _load_dataset(ref.path, text_field)
            value = _WORKER[key][ref.start][text_field]
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


def _read_messages(ref: DocRef, field: str) -> Any:
    """The --messages-field value of one record (raises ConversationError when it has none)."""
    if ref.kind == "row":
        key = ("dataset", ref.path)
        if key not in _WORKER:
            _WORKER[key] = _load_dataset(ref.path, field)
        return _WORKER[key][ref.start][field]
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
                        tokenizer: Tokenizer) -> dict[str, Any]:
    """Worker, --format chat: render, tokenize and mask each conversation of one shard; write it with its mask."""
    template, dtype = _chat_template(options), token_dtype(tokenizer.vocab_size)
    pieces, masks, lengths, names = [], [], [], []
    histogram = np.zeros(256, dtype=np.int64)
    skipped = 0
    for ref in refs:
        try:
            ids, mask, assistant_text = encode_conversation(template, tokenizer.encode_with_offsets,  # type: ignore[attr-defined]
                                                            _read_messages(ref, options["messages_field"]),
                                                            options["messages_field"])
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


def _prepare_shard(job: tuple[str, str, int, list[DocRef], dict[str, Any]]) -> dict[str, Any]:
    """Worker: read, tokenize and write one shard; return its entry."""
    out, split, index, refs, options = job
    key = ("tokenizer", options["tokenizer"])  # per spec: one process may prepare with several tokenizers
    if key not in _WORKER:
        _WORKER[key] = build_tokenizer(options["tokenizer"])
    tokenizer = _WORKER[key]
    if options.get("format") == "chat":
        return _prepare_chat_shard(out, split, index, refs, options, tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    pieces, lengths, names = [], [], []
    histogram = np.zeros(256, dtype=np.int64)
    for ref in refs:
        text = _read_text(ref, options["text_field"], options["skip_bad_files"])
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
_SPLIT_FILE = re.compile(r"^(shard_\d{5,}\.(tokens\.npy|offsets\.npy|json)|\.shard_\d{5,}\.[a-z.]+\.tmp-\d+)$")
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
    refs = document_refs(args.input, args.glob, field, args.skip_bad_files)
    text_options: dict[str, Any] = {"text_field": args.text_field, "skip_bad_files": args.skip_bad_files}
    framing = "template" if chat else args.framing
    if not chat and not frames_with_bos(args.tokenizer, tokenizer, args.framing):
        text_options["bos"] = False  # (only then, so the plan of a bos_eos prepare stays what it was)
    if chat:  # (only then, so the plan of a text prepare, and a rerun over its shards, stays what it was)
        text_options.update(format="chat", messages_field=args.messages_field,
                            chat_template_sha256=chat["template_sha256"], chat_template=args.chat_template)
    jobs, entries = [], {}
    for split, split_list in split_refs(refs, args.heldout_fraction).items():
        for index, shard_refs in enumerate(cut_shards(split_list, int(args.shard_mb * 1e6))):
            key = plan_key(shard_refs, identity, text_options)
            entry_path = out / f"{shard_stem(split, index)}.json"
            entry = read_shard_entry(entry_path)
            if entry is None:
                jobs.append((str(out), split, index, shard_refs,
                             {**text_options, "tokenizer": args.tokenizer, "plan": key}))
            elif entry.get("plan") != key:
                raise ConfigError(f"{entry_path} is a finished shard of other inputs or options; finished shards "
                                  "are never rewritten: use another --out or remove that directory")
            else:
                entries[(split, index)] = entry
    planned = {(job[1], job[2]) for job in jobs} | set(entries)
    for split in SPLITS:
        for stale in sorted((out / split).glob("shard_*.json")) if (out / split).is_dir() else []:
            if (split, int(stale.stem.split("_")[1])) not in planned:
                raise ConfigError(f"{stale} is a finished shard of other inputs or options; use another --out "
                                  "or remove that directory")
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:  # files cut short by an interrupted run: never complete, never renamed, only in the way
        for partial in (out / split).glob(".shard_*.tmp-*") if (out / split).is_dir() else []:
            partial.unlink()
    if entries:
        log.info("%d of %d shards already finished in %s; preparing the rest", len(entries), len(planned), out)
    started = time.perf_counter()
    bar = tqdm.tqdm(total=len(jobs), unit="shard", disable=args.quiet or not jobs, dynamic_ncols=True)
    tokens_done = 0
    try:
        if args.workers == 1 or len(jobs) <= 1:
            results = map(_prepare_shard, jobs)
            pool = None
        else:
            # fork: the workers start in milliseconds and inherit the imports; spawn would re-import torch.
            pool = multiprocessing.get_context("fork").Pool(min(args.workers, len(jobs)))
            results = pool.imap_unordered(_prepare_shard, jobs)
        for entry in results:
            entries[(entry["split"], entry["index"])] = entry
            tokens_done += entry["n_tokens"]
            bar.update(1)
            bar.set_postfix_str(f"{tokens_done / max(time.perf_counter() - started, 1e-9) / 1e6:.2f}M tokens/s")
        if pool is not None:
            pool.close()
            pool.join()
    except BaseException:
        if pool is not None:
            pool.terminate()
        raise
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    if chat:
        chat["skipped_documents"] = sum(e.get("skipped_documents", 0) for e in entries.values())
        chat["loss_tokens"] = {split: sum(e.get("n_loss_tokens", 0) for e in entries.values() if e["split"] == split)
                               for split in SPLITS}
    manifest = write_manifest(out, args.tokenizer, identity, token_dtype(tokenizer.vocab_size),
                              args.heldout_fraction, list(entries.values()), text_field=args.text_field,
                              inputs=list(args.input), framing=framing, **({"chat": chat} if chat else {}))
    new_tokens = sum(entries[(job[1], job[2])]["n_tokens"] for job in jobs)
    if chat:
        log.info("conversations: %d + %d assistant tokens to learn from (train + held-out); %d conversations "
                 "skipped", chat["loss_tokens"]["train"], chat["loss_tokens"]["heldout"], chat["skipped_documents"])
    log.info("prepared %s: %d train + %d held-out documents, %d + %d tokens (%s), %d shards (%d new, %.1fs, "
             "%.2fM tokens/s)", out, manifest["train_documents"], manifest["heldout_documents"],
             manifest["train_tokens"], manifest["heldout_tokens"], manifest["dtype"], len(entries), len(jobs),
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
