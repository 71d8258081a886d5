"""LoRA adapter gradients under the looped and V-shaped pipeline schedules against one float64 process.

    PYTHONPATH=$PWD/src:$PWD/tests:$PWD/tests/distributed python benchmarks/parity/lora_pp_schedules.py

The suite checks 1F1B (tests/distributed/test_lora_dist.py); this runs the same Trainer step and reference
with 4 microbatches per data rank under ZBVZeroBubble and Interleaved1F1B (2 stages per rank, pp 2 x FSDP 2
on 4 gloo ranks) and prints the worst relative error. A check run by hand: it asserts nothing.
"""

from __future__ import annotations

import tempfile

import test_lora_dist as lora_dist
import torch

from moetrain.testing import run_on_ranks


def main() -> None:
    for schedule in ("ZBVZeroBubble", "Interleaved1F1B"):
        cfg = lora_dist._pp_job(4, pp=2, pp_schedule=schedule, pp_stages_per_rank=2)
        batches = lora_dist.make_pp_batches(2, 4, seed=5)
        with tempfile.TemporaryDirectory() as tmp:
            per_rank = run_on_ranks(lora_dist.pp_worker, 4, cfg, batches, tmp, timeout=300)
        grads = {}
        for result in per_rank:
            result["grads"].pop("base with a gradient")
            grads.update({k: torch.from_numpy(v).double() for k, v in result["grads"].items()})
        error, where = lora_dist.relative_error(grads, lora_dist.pp_reference_grads(cfg, batches))
        print(f"{schedule}: {len(grads)} adapter gradients, max relative error {error:.2e} at {where}")


if __name__ == "__main__":
    main()
