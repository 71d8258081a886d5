"""What the checkpoint manifest costs: sha256 of every file against the whole save, and against reading.

    .venv/bin/python benchmarks/profile/checkpoint_hash_cost.py [--pairs 7]

One process, the default model (`configs/tiny_moe.toml`) after one AdamW step, so the checkpoint
holds weights and both moment buffers. Each round, side by side: a whole `save_checkpoint` (DCP
safetensors write, JSON state, manifest), then over the files it wrote a plain read, a sha256
and a zlib.crc32 (the cheap alternative a manifest could use). Reported: medians over the rounds
of sha256 / save, sha256 / read and crc32 / read (the page cache is warm for all three reads,
so these compare the hashing work with moving the bytes, not with a cold disk). Writes a JSON.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

from moetrain.args import take_option
from moetrain.checkpoint.state import capture_rng_state
from moetrain.checkpoint.storage import save_checkpoint
from moetrain.config.job import load
from moetrain.model.transformer import Transformer

CHUNK = 1 << 20


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, chunk: bytes) -> None:
        self.value = zlib.crc32(chunk, self.value)


def _read(paths: list[Path], update) -> float:
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                update(chunk)
    return time.perf_counter() - start


def main() -> int:
    pairs, _ = take_option(sys.argv[1:], "pairs")
    rounds = int(pairs or 7)
    torch.set_num_threads(1)
    cfg = load("configs/tiny_moe.toml")
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 64))
    model(tokens).float().square().mean().backward()
    optimizer.step()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for step in range(1, rounds + 2):  # the first round warms up and is dropped
            start = time.perf_counter()
            ref = save_checkpoint(tmp, step, model, optimizer, {}, {"rng": capture_rng_state()},
                                  keep_last=1, config=cfg.to_dict())
            save_s = time.perf_counter() - start
            files = _files(ref.path)
            read_s = _read(files, lambda chunk: None)
            digest = hashlib.sha256()
            sha_s = _read(files, digest.update)
            crc_s = _read(files, _Crc32().update)
            rows.append({"save_s": save_s, "read_s": read_s, "sha256_s": sha_s, "crc32_s": crc_s,
                         "bytes": sum(p.stat().st_size for p in files)})
            shutil.rmtree(ref.path)
    rows = rows[1:]
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    result = {"rounds": rounds, "checkpoint_bytes": rows[0]["bytes"],
              "sha256_over_save": statistics.median(r["sha256_s"] / r["save_s"] for r in rows),
              "sha256_over_read": statistics.median(r["sha256_s"] / r["read_s"] for r in rows),
              "crc32_over_read": statistics.median(r["crc32_s"] / r["read_s"] for r in rows),
              "median_s": med, "rows": rows}
    print(f"checkpoint {result['checkpoint_bytes'] / 2**20:.1f} MiB, {rounds} rounds: sha256 / whole save "
          f"{result['sha256_over_save']:.3f}, sha256 / read {result['sha256_over_read']:.2f}, "
          f"crc32 / read {result['crc32_over_read']:.2f}")
    out = Path("benchmarks/results/checkpoint_hash_cost.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
