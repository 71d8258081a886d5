"""Peak memory of `moetrain data prepare` on a Parquet input of N MB and of 4N MB, with and without --streaming.

`python benchmarks/prepare_streaming.py [--mb 8] [--shard-mb 1] [--out benchmarks/results/prepare_streaming.json]`
writes two Parquet files of random text documents (N and 4N MB on disk, incompressible words) in a
temporary directory, and prepares each (byte tokenizer, text format, one worker) in a fresh child
process, with and without --streaming; the child's peak resident set (ru_maxrss, which counts the pages
of memory-mapped files it touched) is what is reported. Without --streaming, `datasets` converts the
input into an Arrow copy in its cache (HF_DATASETS_CACHE, pointed into the temporary directory here)
and the workers read rows from its memory map, and the main process holds a reference per row; with it,
rows stream through a batch at a time. Everything is removed afterwards; the shards of the two modes are
checked to be byte-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import sys, time
from moetrain.data.prepare import PrepareArgs, prepare
started = time.perf_counter()
prepare(PrepareArgs(input=[sys.argv[1]], out=sys.argv[2], shard_mb=float(sys.argv[3]), streaming=sys.argv[4] == "1",
                    heldout_fraction=0.01, quiet=True))
print(time.perf_counter() - started)
"""


def write_parquet(path: Path, megabytes: float, seed: int) -> int:
    """Random documents of random lowercase words, about `megabytes` of text, uncompressed (so the file's size
    is the text's); returns the number of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    texts, size = [], 0
    while size < megabytes * 1e6:
        texts.append(" ".join("".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(rng.randint(20, 400))))
        size += len(texts[-1])
    pq.write_table(pa.table({"text": texts}), str(path), compression="none", row_group_size=2000)
    return len(texts)


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def run_child(source: Path, out: Path, shard_mb: float, streaming: bool, env: dict[str, str]) -> tuple[float, float]:
    """(peak RSS in MB, seconds) of one prepare in a fresh process."""
    process = subprocess.Popen([sys.executable, "-c", CHILD, str(source), str(out), str(shard_mb),
                                "1" if streaming else "0"], env=env, stdout=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = float(process.stdout.read().strip() or "nan")
    process.stdout.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"prepare of {source} failed")
    return usage.ru_maxrss / 1024, seconds  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=8.0, help="N: the smaller input's size on disk, MB")
    parser.add_argument("--shard-mb", type=float, default=1.0)
    parser.add_argument("--out", default="benchmarks/results/prepare_streaming.json")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="moetrain_prepare_streaming_"))
    env = {**os.environ, "HF_DATASETS_CACHE": str(root / "hf_cache"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    results = []
    try:
        for factor in (1, 4):
            source = root / f"docs_{factor}.parquet"
            rows = write_parquet(source, args.mb * factor, seed=factor)
            digests = {}
            for streaming in (True, False):
                out = root / f"out_{factor}_{int(streaming)}"
                shutil.rmtree(root / "hf_cache", ignore_errors=True)
                peak, seconds = run_child(source, out, args.shard_mb, streaming, env)
                digests[streaming] = tree_digest(out)
                shards = sum(1 for _ in out.rglob("shard_*.json"))
                results.append({"input_mb": round(source.stat().st_size / 1e6, 2), "rows": rows,
                                "streaming": streaming, "peak_rss_mb": round(peak, 1), "seconds": round(seconds, 2),
                                "shards": shards})
                print(json.dumps(results[-1]), flush=True)
                shutil.rmtree(out)
            assert digests[True] == digests[False], "streaming and map-style shards differ"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    by = {(r["input_mb"] > args.mb * 2, r["streaming"]): r for r in results}
    summary = {mode: round(by[(True, s)]["peak_rss_mb"] - by[(False, s)]["peak_rss_mb"], 1)
               for mode, s in (("streaming", True), ("map_style", False))}
    report = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), "shard_mb": args.shard_mb,
              "measured_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "machine": "shared 2-core CPU machine (other jobs running)", "runs": results,
              "peak_rss_growth_mb_from_N_to_4N": summary, "shards_byte_identical": True}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
