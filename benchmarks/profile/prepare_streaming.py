"""Peak memory of `moetrain data prepare --streaming` as its input grows (Parquet and JSON Lines, text and chat).

`python benchmarks/profile/prepare_streaming.py [--sizes 16 64 256] [--inputs parquet json] [--formats text chat]
[--chat-sizes 4 16] [--map-style-max-mb 64] [--row-group-rows 2000] [--shard-mb 1]
[--out benchmarks/results/prepare_streaming.json]`

For each input kind (a `.parquet` file, uncompressed, written in row groups of --row-group-rows rows, 0 = one row
group; a `.json` file of JSON Lines), each format (text: a `text` column; chat: a `messages` column of a user and an
assistant turn, prepared with --format chat and a small BPE tokenizer whose directory holds a ChatML template, as
the tests build it) and each size (MB of text), it writes the input into a temporary directory and prepares it in a
fresh child process with --streaming (byte tokenizer for text, one worker, --shard-mb), and up to --map-style-max-mb
also without it, checking that both ways' shard trees are byte-identical. Reported per run: the child's peak
resident set (its VmHWM at the end, which counts the pages of memory-mapped files it touched; torch and datasets are
imported by then: an import-only child is measured as the baseline. Not ru_maxrss: Linux carries the spawning
process's high-water mark across exec into it, so a parent that had built a large input reported its own peak as the
child's), the peak of pyarrow's default memory pool (`max_memory()`, what Arrow held at most), seconds and shards.
The documents are random lowercase "words" (numpy, seeded), 130 to 2,600 characters each. Everything is removed
afterwards; the table goes to stdout and to --out with .txt, the runs to --out as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys, time
spec = json.loads(sys.argv[1])
from moetrain.data.prepare.command import PrepareArgs, prepare
import datasets, pyarrow
def peak_rss():  # this program's own high-water mark (VmHWM), in KiB
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
if spec["input"] is None:  # the baseline: the imports alone
    print(json.dumps({"seconds": 0.0, "arrow_peak": 0, "peak_rss_kib": peak_rss()})); raise SystemExit
started = time.perf_counter()
prepare(PrepareArgs(input=[spec["input"]], out=spec["out"], tokenizer=spec["tokenizer"], format=spec["format"],
                    shard_mb=spec["shard_mb"], streaming=spec["streaming"], heldout_fraction=0.01, quiet=True))
print(json.dumps({"seconds": time.perf_counter() - started, "arrow_peak": pyarrow.default_memory_pool().max_memory(),
                  "peak_rss_kib": peak_rss()}))
"""

# Letters and spaces drawn uniformly: words of about 5 letters.
ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz      ", dtype=np.uint8)
CHUNK_ROWS = 2000


def document_chunks(megabytes: float, seed: int):
    """Lists of CHUNK_ROWS random documents, about `megabytes` of text in all."""
    rng = np.random.default_rng(seed)
    size = 0
    while size < megabytes * 1e6:
        lengths = rng.integers(130, 2600, CHUNK_ROWS)
        lengths = lengths[:int(np.searchsorted(np.cumsum(lengths), megabytes * 1e6 - size)) + 1]
        text = ALPHABET[rng.integers(0, ALPHABET.size, int(lengths.sum()))].tobytes().decode("ascii")
        ends = np.cumsum(lengths)
        yield [text[end - length:end] for end, length in zip(ends.tolist(), lengths.tolist())]
        size += int(lengths.sum())


def records(chunk: list[str], fmt: str) -> list[dict]:
    if fmt == "text":
        return [{"text": text} for text in chunk]
    return [{"messages": [{"role": "user", "content": text[:len(text) // 5]},
                          {"role": "assistant", "content": text[len(text) // 5:]}]} for text in chunk]


def write_input(path: Path, fmt: str, megabytes: float, row_group_rows: int, seed: int) -> int:
    """The input file (Parquet or JSON Lines by its suffix); returns its number of rows."""
    rows = 0
    if path.suffix == ".json":
        with open(path, "w") as handle:
            for chunk in document_chunks(megabytes, seed):
                handle.write("".join(json.dumps(r) + "\n" for r in records(chunk, fmt)))
                rows += len(chunk)
        return rows
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = (pa.Table.from_pylist(records(chunk, fmt)) for chunk in document_chunks(megabytes, seed))
    if row_group_rows == 0:  # one row group: the whole table at once
        table = pa.concat_tables(list(tables))
        pq.write_table(table, str(path), compression="none", row_group_size=table.num_rows)
        return table.num_rows
    writer = None
    for table in tables:
        writer = writer or pq.ParquetWriter(str(path), table.schema, compression="none")
        writer.write_table(table, row_group_size=row_group_rows)
        rows += table.num_rows
    writer.close()
    return rows


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def run_child(spec: dict, env: dict[str, str]) -> dict:
    """Peak RSS (MB), seconds and Arrow's pool peak of one prepare in a fresh process."""
    process = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, stdout=subprocess.PIPE,
                             text=True)
    if process.returncode != 0:
        raise SystemExit(f"prepare of {spec['input']} failed")
    measured = json.loads(process.stdout.strip().splitlines()[-1])
    return {"peak_rss_mb": round(measured["peak_rss_kib"] / 1024, 1),
            "arrow_pool_peak_mib": round(measured["arrow_peak"] / 2**20, 1), "seconds": round(measured["seconds"], 1)}


def table_text(report: dict) -> str:
    base = report["imports_peak_rss_mb"]
    lines = [f"imports alone (torch, datasets, moetrain): peak RSS {base} MB",
             "| input | format | MB | rows | row group rows | --streaming | peak RSS MB | above imports MB "
             "| Arrow pool peak MiB | s | shards |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        lines.append(f"| {r['input']} | {r['format']} | {r['input_mb']} | {r['rows']} | {r['row_group_rows'] or '-'} "
                     f"| {'yes' if r['streaming'] else 'no'} | {r['peak_rss_mb']} "
                     f"| {round(r['peak_rss_mb'] - base, 1)} "
                     f"| {r['arrow_pool_peak_mib']} | {r['seconds']} | {r['shards']} |")
    lines.append("")
    for key, spread in report["streaming_peak_rss_spread_mb"].items():
        lines.append(f"--streaming, {key}: peak RSS from {spread['min']} to {spread['max']} MB "
                     f"(spread {spread['spread']} MB) over inputs of {spread['sizes_mb']} MB")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[16, 64, 256], help="text sizes, MB")
    parser.add_argument("--chat-sizes", type=float, nargs="+", default=[4, 16],
                        help="text sizes for --format chat (its tokenizer and template are slower), MB")
    parser.add_argument("--inputs", nargs="+", default=["parquet", "json"], choices=["parquet", "json"])
    parser.add_argument("--formats", nargs="+", default=["text", "chat"], choices=["text", "chat"])
    parser.add_argument("--map-style-max-mb", type=float, default=64.0,
                        help="also prepare without --streaming (and compare the shards) up to this size")
    parser.add_argument("--row-group-rows", type=int, default=2000, help="Parquet row group rows; 0 = one group")
    parser.add_argument("--shard-mb", type=float, default=1.0)
    parser.add_argument("--out", default="benchmarks/results/prepare_streaming.json")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="moetrain_prepare_streaming_"))
    env = {**os.environ, "HF_DATASETS_CACHE": str(root / "hf_cache"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(
               [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    runs: list[dict] = []
    try:
        imports = run_child({"input": None}, env)["peak_rss_mb"]
        print(f"imports alone: peak RSS {imports} MB", flush=True)
        chat_tokenizer = None
        if "chat" in args.formats:
            sys.path.insert(0, str(REPO / "tests"))
            from chat_fixtures import TEMPLATES, tokenizer_dir

            chat_tokenizer = str(tokenizer_dir(root / "tokenizer", TEMPLATES["qwen_chatml"]))
        for kind in args.inputs:
            for fmt in args.formats:
                for megabytes in args.sizes if fmt == "text" else args.chat_sizes:
                    source = root / f"{fmt}_{megabytes:g}.{kind}"
                    rows = write_input(source, fmt, megabytes, args.row_group_rows, seed=int(megabytes * 10))
                    digests = {}
                    for streaming in (True, False) if megabytes <= args.map_style_max_mb else (True,):
                        out = root / "out"
                        shutil.rmtree(root / "hf_cache", ignore_errors=True)
                        measured = run_child({"input": str(source), "out": str(out), "shard_mb": args.shard_mb,
                                              "streaming": streaming, "format": fmt,
                                              "tokenizer": chat_tokenizer if fmt == "chat" else "byte"}, env)
                        digests[streaming] = tree_digest(out)
                        runs.append({"input": kind, "format": fmt, "input_mb": round(source.stat().st_size / 1e6, 1),
                                     "rows": rows, "row_group_rows": args.row_group_rows if kind == "parquet" else None,
                                     "streaming": streaming, **measured,
                                     "shards": sum(1 for _ in out.rglob("shard_*.json"))})
                        print(json.dumps(runs[-1]), flush=True)
                        shutil.rmtree(out)
                    source.unlink()
                    if len(digests) == 2:
                        assert digests[True] == digests[False], f"streaming and map-style shards of {source} differ"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    spread = {}
    for kind in args.inputs:
        for fmt in args.formats:
            peaks = [(r["input_mb"], r["peak_rss_mb"]) for r in runs
                     if r["streaming"] and (r["input"], r["format"]) == (kind, fmt)]
            spread[f"{kind} {fmt}"] = {"sizes_mb": [p[0] for p in peaks], "min": min(p[1] for p in peaks),
                                       "max": max(p[1] for p in peaks),
                                       "spread": round(max(p[1] for p in peaks) - min(p[1] for p in peaks), 1)}
    report = {"what": __doc__.splitlines()[0], "command": "python " + " ".join(sys.argv), "shard_mb": args.shard_mb,
              "measured_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "machine": "shared 2-core CPU machine (other jobs running)", "imports_peak_rss_mb": imports,
              "runs": runs, "streaming_peak_rss_spread_mb": spread,
              "shards_byte_identical": "checked for every size run both ways"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".txt").write_text(table_text(report))
    print(table_text(report))


if __name__ == "__main__":
    main()
