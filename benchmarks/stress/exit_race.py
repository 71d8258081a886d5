"""The SIGABRT-at-exit race in miniature: a 2-rank gloo collective, then interpreter exit.

`python benchmarks/stress/exit_race.py --pairs 10` alternates two torchrun launches of this file
as a worker: "barrier" ends with a plain `dist.barrier()` (the old end of a run), "leave"
with `moetrain.parallel.collectives.leave_together()`. Each worker sets a long GIL switch
interval so the main thread keeps the GIL from the last collective to interpreter
shutdown, when gloo's worker thread, still to release that collective's tensors, needs
it: with the barrier some launches abort ("terminate called without an active
exception"), with leave_together none should. Prints the non-zero exits of each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moetrain.parallel.collectives import leave_together


def worker(ending: str) -> None:
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(4))
    sys.setswitchinterval(100)  # the main thread keeps the GIL unless it blocks
    if ending == "leave":
        leave_together()
    else:
        dist.barrier()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--worker", choices=["barrier", "leave"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    failures = {"barrier": 0, "leave": 0}
    for _ in range(args.pairs):
        for ending in failures:
            done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", __file__, "--worker", ending],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=120)
            failures[ending] += done.returncode != 0
    for ending, count in failures.items():
        print(f"{ending}: {count} of {args.pairs} launches exited non-zero")
    return 0


if __name__ == "__main__":
    sys.exit(main())
