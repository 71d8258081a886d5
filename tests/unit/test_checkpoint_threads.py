"""A one-process job's checkpoint save and load run no tensor work on the process group's own threads.

Why it matters: an intra-op parallel region entered from another live thread (gloo's worker threads run the
copies of DCP's collectives) gives that thread an OpenMP team of its own; libgomp then manages more threads
than there are cores and stops its workers' spinning between regions, so every later parallel region of the
training loop waits for its workers to wake. The default job's steps became 1.6x slower from the first
checkpoint on (docs/results.md, "The default job's wall time (round 22)"). What is observable without a clock:
such a team's worker is a native thread that stays for the life of the process group, so the process's
native threads must be as many after a save and a load as before.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moetrain.checkpoint.storage import load_checkpoint, save_checkpoint


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_a_one_process_save_and_load_leave_no_team_on_the_process_groups_threads(tmp_path):
    # Enough tensors that DCP's gathered save plan is larger than one parallel region's grain.
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(100)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    previous = torch.get_num_threads()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # as `moetrain train` runs
    try:
        torch.set_num_threads(2)
        torch.randn(1 << 20).mul_(2)  # the training thread's own team exists before counting
        before = _native_threads()
        ref = save_checkpoint(tmp_path, 1, model, optimizer, {}, {}, keep_last=1)
        assert _native_threads() == before
        load_checkpoint(ref, model, optimizer)
        assert _native_threads() == before
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(previous)
