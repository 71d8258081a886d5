"""Start-up cost of training from token shards: what is checked at start vs at each shard's first read.

`python benchmarks/profile/shard_startup.py [--tokens 250000000] [--shard-tokens 32000000] [--repeats 2]`
writes synthetic byte shards (moetrain.bench.data.synthetic_corpus) in a temporary directory and
times `load_training_data` (manifest, headers, sizes, offsets), `data verify` (every file's sha256,
what start-up cost before hashing moved to the first read), the first batch of shard 0 (which pays
that shard's sha256) and the next batch. The directory is removed afterwards.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from moetrain.bench.data import synthetic_corpus
from moetrain.config.data import DataConfig
from moetrain.config.job import JobConfig
from moetrain.data.dataset import load_training_data
from moetrain.data.shards import verify_directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=250_000_000)
    parser.add_argument("--shard-tokens", type=int, default=32_000_000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="moetrain_shard_startup_"))
    try:
        shards = root / "shards"
        synthetic_corpus(shards, n_tokens=args.tokens, shard_tokens=args.shard_tokens, seed=0)
        cfg = JobConfig()
        cfg.data = DataConfig(source="tokens", path=str(shards), heldout_fraction=0.01)
        size = sum(p.stat().st_size for p in shards.rglob("*.npy"))
        for _ in range(args.repeats):
            started = time.perf_counter()
            data = load_training_data(cfg)
            start = time.perf_counter() - started
            started = time.perf_counter()
            verify_directory(shards)
            verify = time.perf_counter() - started
            started = time.perf_counter()
            data.train.batch([0])
            first = time.perf_counter() - started
            started = time.perf_counter()
            data.train.batch([1])
            second = time.perf_counter() - started
            print(f"{size / 1e9:.2f} GB of shards: start-up {start:.3f} s; data verify {verify:.2f} s; first batch "
                  f"(hashes shard 0) {first:.3f} s; next batch {second * 1e3:.2f} ms")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
