"""`moetrain bench attention`: the document-masked attention methods side by side against the dense mask.

For each document mix (rows of `seq` tokens cut from a stream of documents with exponentially
distributed lengths, as packing cuts them) it times forward+backward of one attention call
(q [B, S, H, D], grouped-query k and v), plan included, for every method of
`moetrain.model.attention`, a few segment tiles and a few query blocks of "blocks". Methods run
in turn inside every repeat, the order rotating between repeats, and each repeat gives a paired
ratio dense time / method time, so machine noise hits both sides of a ratio alike; the report
gives the median ratio and its spread
(min, quartiles, max). "flex" runs on CUDA only (no CPU backward in torch 2.13).

Writes `bench_attention.json`, `.txt` (the table) and `.png` under `--out_dir`
(benchmarks/results/ by default). This is a benchmark, not a test: it asserts nothing about time.
User errors raise ConfigError.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import torch

from moetrain.args import check_output_path, parse_typed_args
from moetrain.bench import results_dir
from moetrain.dtypes import DTYPES
from moetrain.errors import ConfigError
from moetrain.model.attention import (
    BLOCK_SIZE,
    SEGMENT_TILE,
    AttentionPlan,
    attend,
    block_layout,
    plan_attention,
    segment_layout,
)

matplotlib.use("Agg")  # the plot goes to a file only; never needs a display

PROG = "moetrain bench attention"


@dataclass
class AttentionBenchOptions:
    mean_doc_lengths: tuple[int, ...] = (64, 256)  # one document mix per mean length
    rows: int = 2
    seq: int = 1024
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 2  # torch intra-op threads on CPU
    warmup: int = 2
    repeats: int = 10
    tiles: tuple[int, ...] = (1, 32, 64)  # extra segment tiles timed beside the default SEGMENT_TILE
    blocks: tuple[int, ...] = (32, 128)  # extra query blocks of "blocks" timed beside the default BLOCK_SIZE
    seed: int = 0
    out_dir: Path = results_dir()
    name: str = "bench_attention"  # file stem of the JSON, table and PNG


def _validate(opts: AttentionBenchOptions) -> None:
    positive = {"rows": opts.rows, "seq": opts.seq, "heads": opts.heads, "kv_heads": opts.kv_heads,
                "head_dim": opts.head_dim, "threads": opts.threads, "repeats": opts.repeats}
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"--{name} = {value} is invalid: must be a positive integer")
    if opts.heads % opts.kv_heads:
        raise ConfigError(f"--kv_heads = {opts.kv_heads} is invalid: must divide --heads = {opts.heads}")
    if opts.warmup < 0:
        raise ConfigError(f"--warmup = {opts.warmup} is invalid: must be >= 0")
    if not opts.mean_doc_lengths or any(m < 1 for m in opts.mean_doc_lengths):
        raise ConfigError(f"--mean_doc_lengths = {opts.mean_doc_lengths} is invalid: need positive lengths")
    if any(t < 1 for t in opts.tiles):
        raise ConfigError(f"--tiles = {opts.tiles} is invalid: tiles must be positive")
    if any(b < 1 for b in opts.blocks):
        raise ConfigError(f"--blocks = {opts.blocks} is invalid: blocks must be positive")
    if opts.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"--dtype = {opts.dtype!r} is invalid: one of float32, bfloat16")
    if opts.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device = {opts.device!r} is invalid: 'cpu' or 'cuda'")
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device = 'cuda' is invalid: no CUDA device is available")
    check_output_path(opts.out_dir, "--out_dir")


def packed_document_ids(rows: int, seq: int, mean_length: float, gen: torch.Generator) -> torch.Tensor:
    """[rows, seq] ids of documents with lengths ceil(Exponential(mean)), packed end to end and cut into rows."""
    lengths: list[int] = []
    while sum(lengths) < rows * seq:
        draw = torch.empty(rows * seq // max(1, int(mean_length)) + 8).exponential_(1 / mean_length, generator=gen)
        lengths += draw.ceil().clamp(min=1).long().tolist()
    stream = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[: rows * seq].view(rows, seq)
    return stream - stream[:, :1]  # ids count from 0 in each row; a document cut at a row end continues as id 0


def _methods(opts: AttentionBenchOptions) -> list[str]:
    methods = (["dense", "segments"] + [f"segments/tile={t}" for t in opts.tiles if t != SEGMENT_TILE] + ["blocks"]
               + [f"blocks/block={b}" for b in opts.blocks if b != BLOCK_SIZE] + ["auto"])
    if opts.device == "cuda":
        methods.insert(2, "flex")
    return methods


def _plan(method: str, ids: torch.Tensor) -> AttentionPlan:
    if method.startswith("segments/tile="):
        return AttentionPlan("segments", segments=segment_layout(ids, tile=int(method.split("=")[1])))
    if method.startswith("blocks/block="):
        return AttentionPlan("blocks", blocks=block_layout(ids, block=int(method.split("=")[1])))
    return plan_attention(ids, method)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _fwd_bwd_seconds(method: str, ids: torch.Tensor, qkv: list[torch.Tensor], grad_out: torch.Tensor,
                     device: str) -> float:
    q, k, v = (t.detach().requires_grad_() for t in qkv)
    _sync(device)
    start = time.perf_counter()
    attend(q, k, v, _plan(method, ids)).backward(grad_out)
    _sync(device)
    return time.perf_counter() - start


def _spread(values: list[float]) -> dict[str, float]:
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "min": min(values), "q1": quartiles[0], "q3": quartiles[2],
            "max": max(values)}


def run_mix(opts: AttentionBenchOptions, mean_length: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(opts.seed)
    ids = packed_document_ids(opts.rows, opts.seq, mean_length, gen).to(opts.device)
    dtype = DTYPES[opts.dtype]
    shapes = [(opts.rows, opts.seq, h, opts.head_dim) for h in (opts.heads, opts.kv_heads, opts.kv_heads)]
    qkv = [torch.randn(s, generator=gen).to(opts.device, dtype) for s in shapes]
    grad_out = torch.randn(shapes[0], generator=gen).to(opts.device, dtype)
    methods = _methods(opts)
    for _ in range(opts.warmup):
        for method in methods:
            _fwd_bwd_seconds(method, ids, qkv, grad_out, opts.device)
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    for repeat in range(opts.repeats):
        rotation = repeat % len(methods)  # a different method goes first in each repeat
        for method in methods[rotation:] + methods[:rotation]:
            seconds[method].append(_fwd_bwd_seconds(method, ids, qkv, grad_out, opts.device))
    layout = segment_layout(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    n_docs = int(starts.sum())
    results = {}
    for method in methods:
        ratios = [d / m for d, m in zip(seconds["dense"], seconds[method], strict=True)]
        results[method] = {"seconds": seconds[method], "seconds_spread": _spread(seconds[method]),
                           "speedup_vs_dense": _spread(ratios)}
    return {"mean_doc_length": mean_length, "documents": n_docs, "tokens_per_document": ids.numel() / n_docs,
            "auto_resolves_to": plan_attention(ids, "auto").method,
            "segment_work_vs_dense": layout.padded_work() / (opts.rows * opts.seq ** 2),
            "block_work_vs_dense": block_layout(ids).work() / (opts.rows * opts.seq ** 2), "methods": results}


def format_table(report: dict[str, Any]) -> str:
    lines = ["mix (mean doc len)  docs  method               median s  speedup vs dense: median [min, q1-q3, max]"]
    for mix in report["mixes"]:
        for method, r in mix["methods"].items():
            s = r["speedup_vs_dense"]
            lines.append(f"{mix['mean_doc_length']:>18d}  {mix['documents']:>4d}  {method:<19s}  "
                         f"{r['seconds_spread']['median']:8.4f}  {s['median']:5.2f}x [{s['min']:.2f}, "
                         f"{s['q1']:.2f}-{s['q3']:.2f}, {s['max']:.2f}]")
        lines.append(f"{'':18s}  auto -> {mix['auto_resolves_to']}; segment work / dense work = "
                     f"{mix['segment_work_vs_dense']:.3f}; block work / dense work = "
                     f"{mix['block_work_vs_dense']:.3f}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    mixes = report["mixes"]
    methods = list(mixes[0]["methods"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(mixes)
    for i, mix in enumerate(mixes):
        spreads = [mix["methods"][m]["speedup_vs_dense"] for m in methods]
        xs = [j + (i - (len(mixes) - 1) / 2) * width for j in range(len(methods))]
        medians = [s["median"] for s in spreads]
        errors = [[s["median"] - s["min"] for s in spreads], [s["max"] - s["median"] for s in spreads]]
        ax.bar(xs, medians, width, yerr=errors, capsize=3, label=f"mean document {mix['mean_doc_length']} tokens")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(methods)), methods, rotation=20, fontsize=8)
    ax.set_ylabel("dense time / method time (fwd+bwd)")
    cfg = report["config"]
    ax.set_title(f"document-masked attention, {cfg['rows']}x{cfg['seq']} tokens, {cfg['heads']}/{cfg['kv_heads']} "
                 f"heads x {cfg['head_dim']}, {cfg['dtype']}, {cfg['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    opts = parse_typed_args(AttentionBenchOptions, argv, PROG)
    _validate(opts)
    if opts.device == "cpu":
        torch.set_num_threads(opts.threads)
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()},
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "mixes": [run_mix(opts, m) for m in opts.mean_doc_lengths]}
    table = format_table(report)
    print(table)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    stem = opts.out_dir / opts.name
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".txt").write_text(table + "\n")
    plot(report, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .txt and .png")
    return 0
