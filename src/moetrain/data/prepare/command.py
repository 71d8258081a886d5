"""`moetrain data prepare` and `moetrain data verify`: the options, their checks, and the flow of one prepare.

A prepare builds the tokenizer, plans the shards (all of them first, or as the records stream by with
--streaming), skips those already finished in --out, runs the rest in the worker pool and writes
manifest.json last. This module sequences those steps and reports them; it must not read documents,
cut shards or tokenize itself (the modules of this package do each).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tqdm

from moetrain.args import parse_typed_args
from moetrain.data.chat import load_chat_template
from moetrain.data.chat_sandbox import TIME_LIMIT_S
from moetrain.data.prepare.hf import HF_PREFIX
from moetrain.data.prepare.inputs import document_refs
from moetrain.data.prepare.output import check_output_dir, remove_partial_files, writes_to
from moetrain.data.prepare.plan import ShardJobs, cut_shards, plan_seed, split_refs, streamed_shards
from moetrain.data.prepare.streaming import map_large_allocations, streamed_records
from moetrain.data.prepare.workers import WORKER_CACHE, run_jobs
from moetrain.data.shards import SPLITS, token_dtype, tokenizer_identity, verify_directory, write_manifest
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
    # --format chat: seconds one conversation's chat template may render for before the record is refused (a
    # template that loops without end); templates are also bounded in call depth and in the text they build.
    template_time_limit: float = TIME_LIMIT_S
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


def prepare(args: PrepareArgs) -> dict[str, Any]:
    """Prepare args.input into args.out; return the manifest."""
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers} is invalid: must be >= 1")
    if not (math.isfinite(args.shard_mb) and args.shard_mb > 0) or args.shard_mb * 1e6 >= 2**63:
        raise ConfigError(f"--shard-mb {args.shard_mb} is invalid: must be a finite number > 0")
    if not 0 <= args.heldout_fraction < 1:
        raise ConfigError(f"--heldout-fraction {args.heldout_fraction} is invalid: must be in [0, 1)")
    if not (math.isfinite(args.template_time_limit) and args.template_time_limit > 0):
        raise ConfigError(f"--template-time-limit {args.template_time_limit} is invalid: must be a finite number > 0")
    if args.format not in ("text", "chat"):
        raise ConfigError(f"--format {args.format!r} is invalid: 'text' or 'chat'")
    if args.chat_template is not None and args.format != "chat":
        raise ConfigError(f"--chat-template {args.chat_template!r} is invalid with --format {args.format}: "
                          "only conversations (--format chat) are rendered with a template")
    check_output_dir(Path(args.out), list(args.input))
    with writes_to(Path(args.out)):
        return _prepare(args)


def _prepare(args: PrepareArgs) -> dict[str, Any]:
    """One prepare whose options and --out are checked: plan, write the shards still to write, then the manifest."""
    WORKER_CACHE.clear()  # tokenizers and datasets of an earlier prepare in this process may have changed on disk
    tokenizer = build_tokenizer(args.tokenizer)
    identity = tokenizer_identity(args.tokenizer, tokenizer)
    out = Path(args.out)
    chat = _chat_manifest(args, tokenizer)
    shards = ShardJobs(out, identity, _text_options(args, tokenizer, chat), args.tokenizer,
                       {"template_time_limit": args.template_time_limit} if chat else None)
    jobs, n_jobs = _streamed_jobs(args, shards) if args.streaming else _planned_jobs(args, shards)
    out.mkdir(parents=True, exist_ok=True)
    remove_partial_files(out)
    started = time.perf_counter()
    _run_with_progress(args, jobs, n_jobs, shards, started)
    if args.streaming:
        shards.check_no_stale()
    seconds = time.perf_counter() - started
    manifest = _write_manifest(args, tokenizer, identity, shards, chat)
    _log_summary(out, manifest, shards, chat, seconds)
    return manifest


def _chat_manifest(args: PrepareArgs, tokenizer: Tokenizer) -> dict[str, Any] | None:
    """--format chat: the manifest's record of the chat template (None for text)."""
    if args.format != "chat":
        return None
    if not hasattr(tokenizer, "encode_with_offsets"):
        raise ConfigError(f"--format chat needs a Hugging Face tokenizer directory, not --tokenizer "
                          f"{args.tokenizer!r}")
    template = load_chat_template(args.tokenizer, args.chat_template)
    # The template's text too: export-hf writes the one the run trained with, whatever the directory holds by then.
    return {"template_sha256": template.sha256, "template": template.text, "messages_field": args.messages_field,
            "chat_template": args.chat_template, "generation_markers": template.has_generation_markers}


def _text_options(args: PrepareArgs, tokenizer: Tokenizer, chat: dict[str, Any] | None) -> dict[str, Any]:
    """The options a shard's tokens depend on besides its documents and the tokenizer (in every plan key)."""
    text_options: dict[str, Any] = {"text_field": args.text_field, "skip_bad_files": args.skip_bad_files}
    if not chat and not frames_with_bos(args.tokenizer, tokenizer, args.framing):
        text_options["bos"] = False  # (only then, so the plan of a bos_eos prepare stays what it was)
    if chat:  # (only then, so the plan of a text prepare, and a rerun over its shards, stays what it was)
        text_options.update(format="chat", messages_field=args.messages_field,
                            chat_template_sha256=chat["template_sha256"], chat_template=args.chat_template)
    if any(spec.startswith(HF_PREFIX) for spec in args.input):  # (only then, as above)
        text_options.update(hf_config=args.hf_config, hf_split=args.hf_split)
    return text_options


def _record_field(args: PrepareArgs) -> str:
    """The field of a record (a .jsonl line or a row) that holds its document."""
    return args.messages_field if args.format == "chat" else args.text_field


def _streamed_jobs(args: PrepareArgs, shards: ShardJobs) -> tuple[Iterable[tuple], None]:
    """The jobs of the shards still to write, planned as the records stream by (a foreign shard is found when its
    index is reached); their number is not known before the end."""
    map_large_allocations()
    records = streamed_records(args.input, args.glob, _record_field(args), args.skip_bad_files,
                               (args.hf_config, args.hf_split))
    planned = streamed_shards(records, args.heldout_fraction, int(args.shard_mb * 1e6),
                              plan_seed(shards.identity, shards.options))
    return (job for job in (shards.job_of(*shard) for shard in planned) if job is not None), None


def _planned_jobs(args: PrepareArgs, shards: ShardJobs) -> tuple[list[tuple], int]:
    """The jobs of the shards still to write, planned whole (and every foreign shard refused) before anything
    is written."""
    refs = document_refs(args.input, args.glob, _record_field(args), args.skip_bad_files,
                         (args.hf_config, args.hf_split))
    jobs = [job for split, split_list in split_refs(refs, args.heldout_fraction).items()
            for index, shard_refs in enumerate(cut_shards(split_list, int(args.shard_mb * 1e6)))
            if (job := shards.job_of(split, index, shard_refs)) is not None]
    shards.check_no_stale()
    if shards.entries:
        log.info("%d of %d shards already finished in %s; preparing the rest", len(shards.entries),
                 len(shards.planned), shards.out)
    return jobs, len(jobs)


def _run_with_progress(args: PrepareArgs, jobs: Iterable[tuple], n_jobs: int | None, shards: ShardJobs,
                       started: float) -> None:
    """Run the jobs in the worker pool with a progress bar of shards and tokens/s since `started`."""
    bar = tqdm.tqdm(total=n_jobs, unit="shard", disable=args.quiet or n_jobs == 0, dynamic_ncols=True)
    tokens_done = 0

    def finished(entry: dict[str, Any]) -> None:
        nonlocal tokens_done
        shards.finished(entry)
        tokens_done += entry["n_tokens"]
        bar.update(1)
        bar.set_postfix_str(f"{tokens_done / max(time.perf_counter() - started, 1e-9) / 1e6:.2f}M tokens/s")

    try:
        run_jobs(jobs, 1 if n_jobs is not None and n_jobs <= 1 else min(args.workers, n_jobs or args.workers),
                 finished)
    finally:
        bar.close()


def _write_manifest(args: PrepareArgs, tokenizer: Tokenizer, identity: dict[str, Any], shards: ShardJobs,
                    chat: dict[str, Any] | None) -> dict[str, Any]:
    """Write manifest.json (last: it makes the directory a dataset), with the conversations' counts for chat."""
    entries = shards.entries.values()
    if not sum(e["n_documents"] for e in entries):  # a directory of no documents is no dataset: no manifest
        skipped = sum(e.get("skipped_documents", 0) for e in entries)
        raise ConfigError(f"--input {' '.join(args.input)} gave no document to write: "
                          + (f"the prepare skipped every record ({skipped}; the warnings above say why)" if skipped
                             else "every record was empty or skipped")
                          + f"; {args.out} holds no dataset")
    if chat:
        chat["skipped_documents"] = sum(e.get("skipped_documents", 0) for e in entries)
        chat["loss_tokens"] = {split: sum(e.get("n_loss_tokens", 0) for e in entries if e["split"] == split)
                               for split in SPLITS}
    return write_manifest(shards.out, args.tokenizer, identity, token_dtype(tokenizer.vocab_size),
                          args.heldout_fraction, list(entries), text_field=args.text_field,
                          inputs=list(args.input), framing="template" if chat else args.framing,
                          **({"chat": chat} if chat else {}))


def _log_summary(out: Path, manifest: dict[str, Any], shards: ShardJobs, chat: dict[str, Any] | None,
                 seconds: float) -> None:
    new_tokens = sum(shards.entries[shard]["n_tokens"] for shard in shards.new_shards)
    if chat:
        log.info("conversations: %d + %d assistant tokens to learn from (train + held-out); %d conversations "
                 "skipped", chat["loss_tokens"]["train"], chat["loss_tokens"]["heldout"], chat["skipped_documents"])
    log.info("prepared %s: %d train + %d held-out documents, %d + %d tokens (%s), %d shards (%d new, %.1fs, "
             "%.2fM tokens/s)", out, manifest["train_documents"], manifest["heldout_documents"],
             manifest["train_tokens"], manifest["heldout_tokens"], manifest["dtype"], len(shards.entries),
             len(shards.new_shards), seconds, new_tokens / max(seconds, 1e-9) / 1e6)


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
