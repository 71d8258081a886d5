"""`moetrain bench data`: token shards end to end: prepare speed, loader throughput, training peak RSS vs corpus size.

Measures, in one run (run it under `flock /tmp/moetrain-heavy.lock`, as every timing here):
1. `data prepare` of the embedded corpus with 1 and with 2 workers, alternated (1, 2, 1, 2, ...)
   into fresh directories after one discarded warm-up; the ratio of the medians, and the serial
   part (listing, splitting and planning the documents) that bounds it.
2. Loader throughput on one core (torch.set_num_threads(1)): the default job's steps read
   through the DataLoader from memory-mapped shards, data.batching "packed" and "token_budget",
   for the embedded corpus and for a synthetic one of `big_tokens` tokens.
3. Peak RSS (the child's own VmHWM, polled)  of short training runs of the default
   job's model, alternated: the default job as it is (stdlib text), on a synthetic shard corpus
   of `small_tokens` tokens, and on one of `big_tokens` tokens; their step throughput is the
   trainer's token consumption the loader is compared with.
4. The cost of checking every shard's sha256 before training, on the big corpus.

Synthetic corpora are random byte tokens cut into documents of random length, written with the
shard writer of moetrain.data.shards (the last 1% of documents held out) and kept in
`work_dir` for the next run. This module measures; it changes nothing about training.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetrain.args import check_output_path, parse_typed_args
from moetrain.bench import results_dir
from moetrain.config.job import load
from moetrain.data.batching import build_batching
from moetrain.data.corpus import stdlib_files
from moetrain.data.dataset import load_training_data
from moetrain.data.loader import DataLoader
from moetrain.data.prepare.command import PrepareArgs, prepare
from moetrain.data.prepare.inputs import document_refs
from moetrain.data.prepare.plan import split_refs
from moetrain.data.shards import (
    MANIFEST,
    open_token_shards,
    read_manifest,
    token_dtype,
    tokenizer_identity,
    write_manifest,
    write_shard,
)
from moetrain.data.tokenizer import ByteTokenizer
from moetrain.errors import ConfigError

RESULTS = results_dir()
SYNTHETIC_HELDOUT = 0.01


@dataclass
class DataBenchOptions:
    """Token shards: prepare 1 vs 2 workers, loader tokens/s on one core, training peak RSS vs corpus size."""

    config: str = "configs/tiny_moe.toml"  # the default job: its model, batch and seq_len
    work_dir: str | None = None  # where corpora and runs go (default: a temporary directory, removed after)
    big_tokens: int = 1_000_000_000  # synthetic corpus for the RSS comparison (uint16: 2 bytes per token)
    small_tokens: int = 5_000_000  # 10 MB of uint16 tokens
    shard_tokens: int = 64 << 20  # tokens per synthetic shard
    prepare_repeats: int = 3  # timed prepares per worker count (after one warm-up)
    prepare_shard_mb: float = 1.0  # the embedded corpus (~12 MB) in ~12 shards: work for 2 workers
    loader_batches: int = 2000  # steps read per loader measurement
    train_steps: int = 8  # steps of each RSS run (throughput: the median of steps 3..)
    train_repeats: int = 2  # RSS runs per corpus, alternated
    seed: int = 0
    # Only the peak-RSS training runs: a memory measurement, not a timing (prepare, loader and check times skipped).
    rss_only: bool = False
    json: str | None = None  # default: benchmarks/results/bench_data.json (and .txt beside it)


def synthetic_corpus(root: Path, n_tokens: int, shard_tokens: int, seed: int) -> dict[str, Any]:
    """Write (or reuse) a corpus of random byte tokens in documents of 64..8191 tokens; return its manifest."""
    about = {"synthetic": {"n_tokens": n_tokens, "shard_tokens": shard_tokens, "seed": seed}}
    if (root / MANIFEST).is_file() and read_manifest(root).get("synthetic") == about["synthetic"]:
        return read_manifest(root)
    shutil.rmtree(root, ignore_errors=True)
    tokenizer = ByteTokenizer()
    dtype = token_dtype(tokenizer.vocab_size)
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < n_tokens:
        lengths += rng.integers(64, 8192, size=max(1, n_tokens // 4096)).tolist()
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    n_docs = int(np.searchsorted(ends, n_tokens)) + 1
    lengths = lengths[:n_docs]
    n_heldout = max(1, int(n_docs * SYNTHETIC_HELDOUT))
    entries = []
    for split, docs in (("train", lengths[:-n_heldout]), ("heldout", lengths[-n_heldout:])):
        bounds = np.concatenate([[0], np.cumsum(docs)])
        first = 0
        index = 0
        while first < docs.size:
            last = int(np.searchsorted(bounds, bounds[first] + shard_tokens, side="right")) - 1
            last = max(last, first + 1)
            offsets = bounds[first: last + 1] - bounds[first]
            tokens = rng.integers(0, 256, size=int(offsets[-1]), dtype=dtype)
            tokens[offsets[:-1]] = tokenizer.bos_id
            tokens[offsets[1:] - 1] = tokenizer.eos_id
            histogram = np.bincount(tokens, minlength=tokenizer.vocab_size)[:256]
            entries.append(write_shard(root, split, index, tokens, offsets,
                                       {"byte_histogram": histogram.tolist()}))
            first, index = last, index + 1
    return write_manifest(root, "byte", tokenizer_identity("byte", tokenizer), dtype, SYNTHETIC_HELDOUT, entries,
                          **about)


def train_bpe(path: Path, vocab_size: int = 4096) -> Path:
    """A byte-level BPE trained on the first 4 MB of the embedded corpus: a tokenizer that costs CPU."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, size = [], 0
    for file in stdlib_files()[1]:
        texts.append(file.read_text(encoding="utf-8", errors="replace"))
        size += len(texts[-1])
        if size > 4_000_000:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def time_prepare(opts: DataBenchOptions, work: Path, tokenizer: str, name: str) -> dict[str, Any]:
    """`data prepare --input stdlib` with 1 and 2 workers, alternated, into fresh directories."""
    def once(workers: int) -> float:
        out = work / f"prepare_{name}_{workers}"
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        prepare(PrepareArgs(input=["stdlib"], out=str(out), tokenizer=tokenizer, workers=workers,
                            shard_mb=opts.prepare_shard_mb, quiet=True))
        return time.perf_counter() - started

    once(1)  # warm-up: page cache, imports
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(opts.prepare_repeats):
        for workers in (1, 2):
            times[workers].append(once(workers))
    started = time.perf_counter()
    split_refs(document_refs(["stdlib"], "**/*", "text"), 0.05)
    plan_s = time.perf_counter() - started
    manifest = read_manifest(work / f"prepare_{name}_1")
    median = {str(w): statistics.median(t) for w, t in times.items()}  # str keys: the same after a JSON round trip
    return {"tokenizer": tokenizer, "seconds": {str(w): t for w, t in times.items()}, "median_s": median,
            "speedup_2_workers": median["1"] / median["2"],
            "serial_plan_s": plan_s, "shards": len(manifest["splits"]["train"]) + len(manifest["splits"]["heldout"]),
            "tokens": manifest["train_tokens"] + manifest["heldout_tokens"]}


def loader_tokens_per_s(opts: DataBenchOptions, shard_dir: Path, batching: str) -> float:
    """Input tokens per second of the default job's steps read through the DataLoader from shards."""
    cfg = load(opts.config)
    cfg.data.source, cfg.data.path, cfg.data.batching = "tokens", str(shard_dir), batching
    cfg.data.heldout_fraction = read_manifest(shard_dir)["heldout_fraction"]
    sequences = load_training_data(cfg).train
    loader = DataLoader(build_batching(sequences, cfg.data, cfg.train.microbatch_size, opts.seed), seed=opts.seed,
                        microbatches_per_rank=cfg.train.grad_accum)
    loader.next_microbatches()
    tokens = 0
    started = time.perf_counter()
    for _ in range(opts.loader_batches):
        tokens += sum(batch.tokens.numel() for batch in loader.next_microbatches())
    return tokens / (time.perf_counter() - started)


def training_run(opts: DataBenchOptions, run_dir: Path, shard_dir: Path | None) -> dict[str, Any]:
    """One short training run in a child process: its peak RSS and median step throughput."""
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [sys.executable, "-m", "moetrain", "train", "--config", opts.config, "--train.steps", str(opts.train_steps),
            "--train.eval_every", "0", "--train.sample_tokens", "0", "--checkpoint.every", str(opts.train_steps),
            "--logging.run_dir", str(run_dir), "--logging.progress_bar", "False"]
    if shard_dir is not None:
        argv += ["--data.source", "tokens", "--data.path", str(shard_dir),
                 "--data.heldout_fraction", str(read_manifest(shard_dir)["heldout_fraction"])]
    started = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # VmHWM of the child's own address space, polled until it exits: the rusage maxrss of a child
    # starts at the parent's peak (the forked copy's high-water mark survives exec), which would
    # hide the child's own peak behind this benchmark's.
    peak_kib = 0
    while child.poll() is None:
        peak_kib = max(peak_kib, _vm_hwm_kib(child.pid))
        time.sleep(0.05)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        raise RuntimeError(f"training run {run_dir} failed with exit status {child.returncode}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    throughput = [r["tokens_per_s"] for r in records if r["kind"] == "train" and r["step"] >= 3]
    return {"peak_rss_mib": peak_kib / 1024, "tokens_per_s": statistics.median(throughput), "wall_s": wall}


def _vm_hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass  # exited between poll() and the read
    return 0


def verify_cost(shard_dir: Path) -> dict[str, float]:
    tokenizer = ByteTokenizer()
    started = time.perf_counter()
    open_token_shards(shard_dir, "byte", tokenizer, verify=False)
    quick = time.perf_counter() - started
    started = time.perf_counter()
    open_token_shards(shard_dir, "byte", tokenizer, verify=True)
    full = time.perf_counter() - started
    size = sum(p.stat().st_size for p in shard_dir.rglob("*.npy"))
    return {"bytes": size, "size_dtype_check_s": quick, "sha256_check_s": full, "sha256_gb_per_s": size / full / 1e9}


def run(opts: DataBenchOptions, work: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    result: dict[str, Any] = {"options": asdict(opts)}
    if not opts.rss_only:
        result["prepare"] = time_prepare(opts, work, "byte", "byte")
        result["prepare_bpe"] = time_prepare(opts, work, str(train_bpe(work / "bpe" / "tokenizer.json")), "bpe")
    small = work / "synthetic_small"
    big = work / "synthetic_big"
    small_manifest = synthetic_corpus(small, opts.small_tokens, opts.shard_tokens, opts.seed)
    big_manifest = synthetic_corpus(big, opts.big_tokens, opts.shard_tokens, opts.seed)
    result["corpora"] = {name: {"tokens": m["train_tokens"] + m["heldout_tokens"],
                                "bytes": sum(p.stat().st_size for p in d.rglob("*.npy"))}
                         for name, m, d in (("small", small_manifest, small), ("big", big_manifest, big))}
    if not opts.rss_only:
        result["loader_tokens_per_s"] = {
            f"{name}_{batching}": loader_tokens_per_s(opts, shard_dir, batching)
            for batching in ("packed", "token_budget")
            for name, shard_dir in (("embedded", work / "prepare_byte_1"), ("synthetic_big", big))}
        result["verify"] = verify_cost(big)
    runs: dict[str, list[dict[str, Any]]] = {"stdlib_text": [], "shards_small": [], "shards_big": []}
    for repeat in range(opts.train_repeats):
        for name, shard_dir in (("stdlib_text", None), ("shards_small", small), ("shards_big", big)):
            runs[name].append(training_run(opts, work / f"run_{name}_{repeat}", shard_dir))
    rss = {name: statistics.median(r["peak_rss_mib"] for r in rs) for name, rs in runs.items()}
    result.update(training_runs=runs, peak_rss_mib=rss, rss_big_over_small=rss["shards_big"] / rss["shards_small"])
    if not opts.rss_only:
        consumption = statistics.median(r["tokens_per_s"] for rs in runs.values() for r in rs)
        result["trainer_tokens_per_s"] = consumption
        result["loader_over_trainer"] = {k: v / consumption for k, v in result["loader_tokens_per_s"].items()}
    return result


def report(result: dict[str, Any]) -> str:
    rss, corpora = result["peak_rss_mib"], result["corpora"]
    lines = [
        f"moetrain bench data: {result['options']['config']}, one core per process"
        + (" -- peak RSS only (no timings)" if result["options"].get("rss_only") else ""),
        "",
        "| measurement | value | target |",
        "|---|---|---|",
    ]
    if "prepare" in result:
        p, b, loader, verify = result["prepare"], result["prepare_bpe"], result["loader_tokens_per_s"], result["verify"]
        lines += [
            f"| prepare embedded corpus ({p['tokens'] / 1e6:.1f}M tokens, {p['shards']} shards), 1 worker | "
            f"{p['median_s']['1']:.2f} s (median of {len(p['seconds']['1'])}) | |",
            f"| prepare, 2 workers | {p['median_s']['2']:.2f} s | |",
            f"| prepare speedup 2 vs 1 worker | {p['speedup_2_workers']:.2f}x | >= 1.6x |",
            f"| serial part (list, split, plan documents) | {p['serial_plan_s']:.2f} s | |",
            f"| the same with a 4096-token BPE ({b['tokens'] / 1e6:.1f}M tokens), 1 worker | "
            f"{b['median_s']['1']:.2f} s | |",
            f"| BPE prepare, 2 workers | {b['median_s']['2']:.2f} s | |",
            f"| BPE prepare speedup 2 vs 1 worker | {b['speedup_2_workers']:.2f}x | |",
            *(f"| loader, {key.replace('_', ' ')} | {value / 1e6:.2f}M tokens/s "
              f"({result['loader_over_trainer'][key]:.0f}x the trainer) | >= 100x |" for key, value in loader.items()),
            f"| trainer consumption, default job | {result['trainer_tokens_per_s']:.0f} tokens/s | |",
            f"| sha256 of every shard ({verify['bytes'] / 1e9:.2f} GB) | {verify['sha256_check_s']:.2f} s "
            f"({verify['sha256_gb_per_s']:.2f} GB/s); size/dtype only {verify['size_dtype_check_s']:.3f} s | |",
        ]
    lines += [
        f"| peak RSS, default job (stdlib text) | {rss['stdlib_text']:.0f} MiB | |",
        f"| peak RSS, shards {corpora['small']['bytes'] / 1e6:.0f} MB ({corpora['small']['tokens'] / 1e6:.1f}M "
        f"tokens) | {rss['shards_small']:.0f} MiB | |",
        f"| peak RSS, shards {corpora['big']['bytes'] / 1e9:.2f} GB ({corpora['big']['tokens'] / 1e9:.2f}G tokens) | "
        f"{rss['shards_big']:.0f} MiB | |",
        f"| RSS big / small | {result['rss_big_over_small']:.3f} | <= 1.10 |",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    opts: DataBenchOptions = parse_typed_args(DataBenchOptions, argv, "moetrain bench data", bool_flags=True)
    for name in ("big_tokens", "small_tokens", "shard_tokens", "prepare_repeats", "loader_batches", "train_steps",
                 "train_repeats"):
        if getattr(opts, name) < 1:
            raise ConfigError(f"{name} = {getattr(opts, name)!r} is invalid: must be a positive integer")
    if opts.seed < 0:  # numpy's generators take seeds >= 0
        raise ConfigError(f"seed = {opts.seed} is invalid: must be >= 0")
    if not opts.prepare_shard_mb > 0:
        raise ConfigError(f"prepare_shard_mb = {opts.prepare_shard_mb!r} is invalid: must be > 0")
    for name in ("work_dir", "json"):
        if getattr(opts, name):
            check_output_path(getattr(opts, name), f"--{name}")
    load(opts.config)  # the job file, read and checked before any corpus is generated
    if opts.rss_only and not opts.json:
        raise ConfigError("rss_only = True needs --json: it must not replace the full results")
    if opts.train_steps < 4:
        raise ConfigError(f"train_steps = {opts.train_steps} is invalid: must be >= 4 (throughput is from step 3 on)")
    if opts.work_dir:
        work = Path(opts.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        result = run(opts, work)
    else:
        with tempfile.TemporaryDirectory(prefix="moetrain-bench-data-") as tmp:
            result = run(opts, Path(tmp))
    text = report(result)
    print(text)
    path = Path(opts.json) if opts.json else RESULTS / "bench_data.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "time": time.time()}, indent=2, default=str) + "\n")
    path.with_suffix(".txt").write_text(text + "\n")
    print(f"json: {path}")
    return 0
