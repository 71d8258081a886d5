"""Where a `moetrain bench train` process's peak RSS goes: live heap bytes against the heap's high-water mark.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/profile/lora_heap.py [--no-reuse] -- BENCH_TRAIN_ARGS...

Runs `moetrain bench train` in this process with a thread that samples, every few milliseconds, the resident
set (/proc/self/statm) and glibc's `mallinfo2` (bytes in use in every arena plus mmapped chunks: the live
host tensors and Python objects), and names the block whose forward or backward was running at each one's
peak. `--no-reuse` leaves glibc's defaults (the mmap path on, so freed large blocks go back to the system),
which `moetrain train` turns off for one process (runtime/allocator.py): the difference between the two peak
RSS values is heap slack, holes the next allocations could not reuse. Linux/glibc only. Asserts nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

import moetrain.bench.train as bench_train
import moetrain.train.trainer as trainer_module
from moetrain.cli import main as cli_main


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def main(argv: list[str]) -> None:
    reuse = "--no-reuse" not in argv
    args = [a for a in argv if a not in ("--no-reuse", "--")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    page = os.sysconf("SC_PAGE_SIZE")
    seen = {"phase": "build", "rss": (0, ""), "live": (0, "")}

    def sample() -> None:
        while True:
            with open("/proc/self/statm") as statm:
                rss = int(statm.read().split()[1]) * page
            info = libc.mallinfo2()
            live = info.uordblks + info.hblkhd
            for key, value in (("rss", rss), ("live", live)):
                if value > seen[key][0]:
                    seen[key] = (value, seen["phase"])
            time.sleep(0.005)

    build = trainer_module.build_for_job

    def build_with_phases(cfg, job):
        model = build(cfg, job)
        for block in model.layers:
            block.register_forward_pre_hook(lambda m, a: seen.__setitem__("phase", f"forward {m.layer_id}"))
            block.register_full_backward_pre_hook(lambda m, g: seen.__setitem__("phase", f"backward {m.layer_id}"))
        return model

    trainer_module.build_for_job = build_with_phases
    if not reuse:
        bench_train.reuse_freed_host_memory = lambda world: False
    threading.Thread(target=sample, daemon=True).start()
    try:
        cli_main(["bench", "train", *args])
    finally:
        print(f"glibc large-block reuse {'on (as moetrain train)' if reuse else 'off (glibc defaults)'}")
        print(f"peak RSS        {seen['rss'][0] / 2**20:8.0f} MiB  during {seen['rss'][1]}")
        print(f"peak live heap  {seen['live'][0] / 2**20:8.0f} MiB  during {seen['live'][1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
