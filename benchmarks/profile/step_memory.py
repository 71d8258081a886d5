"""What one step's peak resident memory is made of, at the issue's one-process shape.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/profile/step_memory.py [--dtype float32] [--threads 2]
        [--steps 2] [--heap-reuse 0] [--json OUT.json] [job overrides ...]

Builds the Trainer `moetrain bench train` builds (`bf16_step_profile.issue_shape_trainer`), then runs
`--steps` steps while a thread samples the process's resident set (/proc/self/statm) every
millisecond and notes in which part of the step each sample fell (forward, backward, clip, optimizer,
zero_grad, other: the calls are wrapped, nothing else changes). It prints, per part, the highest
resident set seen in it, beside what the tensors alone must hold: parameters, their float32
gradients and the optimizer's state (bf16 compute copies are not counted); the difference is activations, transients,
torch's own memory and the heap's slack (glibc's free-but-kept bytes, read with mallinfo2 at the
end; `--heap-reuse 0` keeps glibc's defaults instead of `reuse_freed_host_memory`, so the difference
of the two peaks is what the heap's kept free blocks add). The VmHWM of the process (the peak
`bench train` reports) closes the table. With the heap kept, the resident set never falls, so the
first part to reach the peak is the one to read. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
import time
from pathlib import Path

import torch
from benchmarks.profile import bf16_step_profile
from benchmarks.profile.bf16_step_profile import issue_shape_trainer

from moetrain.args import take_option

MIB = 2**20
_PAGE = 4096


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_free_bytes() -> int | None:
    """Bytes glibc's heap holds free (fordblks of mallinfo2), or None off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        return int(libc.mallinfo2().fordblks)
    except (OSError, AttributeError):
        return None


class PhaseSampler:
    """A thread that keeps, per label, the highest resident set sampled while that label was current."""

    def __init__(self) -> None:
        self.label = "other"
        self.peaks: dict[str, int] = {}
        self.reached_in = ("other", 0)  # (label, step) where the resident set last rose to its maximum
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = _rss_bytes()
            if rss > max(self.peaks.values(), default=0):
                self.reached_in = (self.label, self.step)
            if rss > self.peaks.get(self.label, 0):
                self.peaks[self.label] = rss
            time.sleep(0.001)

    def wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)

        def labelled(*args, **kwargs):
            previous, self.label = self.label, label
            try:
                return original(*args, **kwargs)
            finally:
                self.label = previous
        setattr(owner, name, labelled)

    def __enter__(self) -> PhaseSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def tensor_bytes(trainer) -> dict[str, int]:
    """What the step's tensors must hold at the end of a backward: parameters, gradients, optimizer state."""
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    state = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return {"parameters": sum(p.numel() * p.element_size() for p in params),
            "gradients": sum(p.numel() * 4 for p in params),  # float32 (the masters' dtype) whatever the compute
            "optimizer_state": state}


def main(argv: list[str]) -> None:
    dtype, argv = take_option(argv, "dtype")
    threads, argv = take_option(argv, "threads")
    steps, argv = take_option(argv, "steps")
    out, argv = take_option(argv, "json")
    heap_reuse, argv = take_option(argv, "heap-reuse")
    if heap_reuse == "0":  # glibc's defaults: large blocks mmapped and returned on free (no slack, fresh pages)
        bf16_step_profile.reuse_freed_host_memory = lambda *args: False
    trainer = issue_shape_trainer(dtype or "float32", int(threads or 2), argv)
    import moetrain.train.trainer as trainer_module

    sampler = PhaseSampler()
    sampler.wrap(trainer.model, "forward", "forward")
    sampler.wrap(torch.Tensor, "backward", "backward")
    sampler.wrap(trainer_module, "clip_grad_norm_", "clip")
    sampler.wrap(trainer.optimizer, "step", "optimizer")
    sampler.wrap(trainer.optimizer, "zero_grad", "zero_grad")
    with sampler:
        for step in range(int(steps or 2)):
            sampler.step = step + 1
            trainer.train_step()
    sizes = tensor_bytes(trainer)
    floor = sum(sizes.values())
    result = {"dtype": trainer.cfg.parallel.param_dtype, "threads": torch.get_num_threads(),
              "peak_rss_by_phase": sampler.peaks, "tensor_bytes": sizes, "tensor_floor": floor,
              "peak_reached_in": sampler.reached_in, "vm_hwm": _hwm_bytes(), "heap_free_at_end": heap_free_bytes()}
    print(f"{result['dtype']}, {result['threads']} threads: tensors that must be held at once "
          + ", ".join(f"{k} {v / MIB:.0f}" for k, v in sizes.items()) + f" = {floor / MIB:.0f} MiB")
    for label, peak in sorted(sampler.peaks.items(), key=lambda kv: -kv[1]):
        print(f"  peak RSS in {label:10s} {peak / MIB:7.0f} MiB  ({(peak - floor) / MIB:+6.0f} over the tensors)")
    free = result["heap_free_at_end"]
    print(f"  VmHWM {result['vm_hwm'] / MIB:.0f} MiB, first reached in {sampler.reached_in[0]} of step "
          f"{sampler.reached_in[1]}; glibc heap free at the end "
          + ("n/a" if free is None else f"{free / MIB:.0f} MiB"))
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
