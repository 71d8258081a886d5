"""The worker processes of `data prepare`: each job reads one shard's records (or takes those that streamed in
with it), tokenizes them and writes the shard; `run_jobs` runs the jobs in a pool.

Text documents are framed [BOS] ids [EOS] (no BOS where the plan's options say so); conversations
(--format chat) are rendered with the chat template and masked to the assistant's tokens
(moetrain.data.chat), and one that cannot be used is refused in one line naming its file and line
(or row), or skipped and counted with --skip-bad-files. A worker holds one shard's tokens at a time.
This module does not plan shards or choose which are written, nor write the manifest.
"""

from __future__ import annotations

import json
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from moetrain.data.chat import ChatTemplate, ConversationError, encode_conversation, load_chat_template
from moetrain.data.prepare.hf import load_dataset
from moetrain.data.prepare.inputs import UNREAD, DocRef
from moetrain.data.prepare.plan import PackedShard
from moetrain.data.shards import token_dtype, write_shard
from moetrain.data.tokenizer import Tokenizer, build_tokenizer
from moetrain.errors import ConfigError
from moetrain.logging import get_logger

log = get_logger("data")

# Per worker process: the tokenizers (each built once) and open datasets, by spec and path.
WORKER_CACHE: dict[str, Any] = {}


def _row_value(ref: DocRef, field: str, hf: tuple[str | None, str]) -> Any:
    key = ("dataset", ref.path)
    if key not in WORKER_CACHE:
        WORKER_CACHE[key] = load_dataset(ref.path, field, hf)
    return WORKER_CACHE[key][ref.start][field]


def _hf_options(options: dict[str, Any]) -> tuple[str | None, str]:
    return options.get("hf_config"), options.get("hf_split", "train")


def _read_text(ref: DocRef, text_field: str, skip_bad: bool, value: Any = UNREAD,
               hf: tuple[str | None, str] = (None, "train")) -> str | None:
    problem = ""
    try:
        if ref.kind == "row":
            value = _row_value(ref, text_field, hf) if value is UNREAD else value
            if value is None or isinstance(value, str):  # a null is an empty document, dropped as those are
                return value
            return _bad_record(f"{_where(ref)}: field {text_field!r} is {type(value).__name__}, not a string",
                               skip_bad)
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
        problem = f"{_where(ref)} is not a JSON object with a string field {text_field!r} ({type(err).__name__})"
    return _bad_record(problem, skip_bad)


def _bad_record(problem: str, skip_bad: bool) -> None:
    """Skip a record that cannot be a document (one warning line) under --skip-bad-files, else refuse it."""
    if skip_bad:
        log.warning("skipping %s", problem)
        return None
    raise ConfigError(f"{problem}; fix or remove it, or pass --skip-bad-files")


def _where(ref: DocRef) -> str:
    """A record's place for messages: FILE:LINE, or FILE row N."""
    if ref.kind == "line":
        return f"{ref.path}:{int(ref.name.rsplit(':', 1)[1])}"
    return f"{ref.path} row {ref.start}" if ref.kind == "row" else ref.path


def _read_messages(ref: DocRef, field: str, value: Any = UNREAD,
                   hf: tuple[str | None, str] = (None, "train")) -> Any:
    """The --messages-field value of one record (raises ConversationError when it has none)."""
    if ref.kind == "row":
        return _row_value(ref, field, hf) if value is UNREAD else value
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
    key = ("chat", options["chat_template_sha256"], options.get("template_time_limit"))
    if key not in WORKER_CACHE:
        template = load_chat_template(options["tokenizer"], options["chat_template"])
        if options.get("template_time_limit") is not None:
            template.limits.time_limit_s = float(options["template_time_limit"])
        WORKER_CACHE[key] = template
    return WORKER_CACHE[key]


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


def prepare_shard(job: tuple[str, str, int, list[DocRef] | PackedShard, dict[str, Any]]) -> dict[str, Any]:
    """Worker: read (or take, when they streamed in with the job), tokenize and write one shard; return its entry."""
    out, split, index, shard, options = job
    refs, values = shard.records() if isinstance(shard, PackedShard) else (shard, [UNREAD] * len(shard))
    key = ("tokenizer", options["tokenizer"])  # per spec: one process may prepare with several tokenizers
    if key not in WORKER_CACHE:
        WORKER_CACHE[key] = build_tokenizer(options["tokenizer"])
    tokenizer = WORKER_CACHE[key]
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


def run_jobs(jobs: Iterable[tuple], workers: int, finished: Callable[[dict[str, Any]], None]) -> None:
    """Run each job (in `workers` processes when > 1), handing every entry to `finished`. At most 2 jobs per
    worker are queued at a time, so a streaming prepare holds a bounded number of shards' records in memory
    (a Pool's imap would draw the whole job iterator into its queue)."""
    if workers <= 1:
        for job in jobs:
            finished(prepare_shard(job))
        return
    # fork: the workers start in milliseconds and inherit the imports; spawn would re-import torch.
    pool = multiprocessing.get_context("fork").Pool(workers)
    pending: deque[Any] = deque()
    try:
        for job in jobs:
            pending.append(pool.apply_async(prepare_shard, (job,)))
            while pending and (len(pending) >= 2 * workers or pending[0].ready()):
                finished(pending.popleft().get())
        while pending:
            finished(pending.popleft().get())
        pool.close()
        pool.join()
    except BaseException:
        pool.terminate()
        raise
