"""Host-memory settings: heap reuse for one-process jobs only (several ranks on a host ran out of
memory with it); huge pages for large tensors only when the user asks (they made a rank's RSS grow)."""

from __future__ import annotations

import ctypes.util
import os
import platform
import subprocess
import sys

import pytest

from moetrain import cli
from moetrain.runtime import allocator


@pytest.mark.parametrize("world_size", [2, 4])
def test_multi_rank_jobs_keep_the_default_allocator(monkeypatch, world_size):
    calls = []
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: calls.append(name))
    assert allocator.reuse_freed_host_memory(world_size) is False
    assert calls == []  # not even looked up


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the heap options are glibc's mallopt settings")
def test_one_process_applies_it_where_glibc_is():
    assert allocator.reuse_freed_host_memory(1) is True


def test_one_process_without_a_c_library_runs_on_with_the_default_allocator(monkeypatch):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert allocator.reuse_freed_host_memory(1) is False


# --- huge pages for several ranks -------------------------------------------------------------

_HUGE_PAGE_PROBE = """
from moetrain.runtime.allocator import huge_pages_for_large_tensors
huge_pages_for_large_tensors()
import torch
tensors = [torch.empty(3 * 2**20 + 1000 * i, dtype=torch.uint8) for i in range(8)]
# A mapping the kernel may back with huge pages carries the 'hg' flag (madvise MADV_HUGEPAGE).
advised, start, end = [], 0, 0
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        start, end = (int(x, 16) for x in head.split("-"))
    elif head == "VmFlags:":
        advised.append((start, end, "hg" in line.split()[1:]))
print(sum(any(lo <= t.data_ptr() < hi and hg for lo, hi, hg in advised) for t in tensors))
"""


@pytest.mark.parametrize("world_size, expected", [("1", None), ("2", "0"), ("4", "0")])
def test_multi_rank_jobs_keep_huge_pages_off_by_default(world_size, expected):
    environ = {"WORLD_SIZE": world_size}
    assert allocator.huge_pages_for_large_tensors(environ) is False
    assert environ.get(allocator.TORCH_THP_VARIABLE) == expected


def test_a_value_the_user_set_wins():
    environ = {"WORLD_SIZE": "4", allocator.TORCH_THP_VARIABLE: "1"}
    assert allocator.huge_pages_for_large_tensors(environ) is True
    assert environ[allocator.TORCH_THP_VARIABLE] == "1"


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps to read mappings from")
@pytest.mark.parametrize("world_size, user_value, advised", [("1", None, 0), ("4", None, 0), ("4", "1", 8)])
def test_torch_asks_the_kernel_for_huge_pages_when_set_before_it_loads(world_size, user_value, advised):
    env = {k: v for k, v in os.environ.items() if k != allocator.TORCH_THP_VARIABLE}
    env["WORLD_SIZE"] = world_size
    if user_value is not None:
        env[allocator.TORCH_THP_VARIABLE] = user_value
    out = subprocess.run([sys.executable, "-c", _HUGE_PAGE_PROBE], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    assert int(out.stdout.split()[-1]) == advised


def test_entry_sets_it_before_running_the_command(monkeypatch):
    order = []
    monkeypatch.setattr(cli, "huge_pages_for_large_tensors", lambda: order.append("huge pages"))
    monkeypatch.setattr(cli, "main", lambda: order.append("main") or 0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit):
        cli.entry()
    assert order == ["huge pages", "main"]
