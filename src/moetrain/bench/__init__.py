"""Benchmarks and the step-time simulator (not tests): `moetrain bench moe|sync|ep|attention|data|train`.

`main` dispatches `moetrain bench NAME` to the benchmark's own `main`, importing that module
only when it is asked for (as moetrain.cli does for subcommands), so `moetrain bench --help`
and importing `moetrain.bench.costs` do not load torch (`simulate` does: it reads torch's pipeline
orders). Benchmarks measure and report; nothing here may change how training runs.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from moetrain.errors import ConfigError


def results_dir() -> Path:
    """Where a benchmark writes when no path is given: the source checkout's benchmarks/results (next to
    src/moetrain), whatever the current directory; for an installed package, ./benchmarks/results."""
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "benchmarks").is_dir() and (checkout / "src" / "moetrain").is_dir():
        return checkout / "benchmarks" / "results"
    return Path("benchmarks/results")


BENCHMARKS = {
    "moe": ("expert implementations side by side: saved bytes and fwd+bwd time", "moetrain.bench.moe:main"),
    "sync": ("HSDP sync policies under inhomogeneous microbatches", "moetrain.bench.sync:main"),
    "data": ("token shards: prepare 1 vs 2 workers, loader tokens/s, training peak RSS on 10 MB vs 1 GB+ corpora",
             "moetrain.bench.data:main"),
    "ep": ("FSDP-only vs expert parallelism: step time, all-to-all, memory, expert bytes gathered",
           "moetrain.bench.ep:main"),
    "attention": ("document-masked attention methods vs the dense mask: fwd+bwd speedup",
                  "moetrain.bench.attention:main"),
    "train": ("a short training job: tokens/s, step phases, peak memory, MFU against a measured peak",
              "moetrain.bench.train:main"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: moetrain bench {" + ",".join(BENCHMARKS) + "} [options]\n")
        for name, (help_text, _) in BENCHMARKS.items():
            print(f"  {name:9s} {help_text}")
        return 0
    if argv[0] not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark {argv[0]!r}; valid benchmarks: {', '.join(BENCHMARKS)}")
    module_name, func_name = BENCHMARKS[argv[0]][1].split(":")
    return int(getattr(importlib.import_module(module_name), func_name)(argv[1:]) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
