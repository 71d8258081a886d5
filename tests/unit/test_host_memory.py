"""The host-memory setting is applied to one-process jobs only (several ranks on a host ran out of memory with it)."""

from __future__ import annotations

import ctypes.util

import pytest

from moetrain.train import host_memory


@pytest.mark.parametrize("world_size", [2, 4])
def test_multi_rank_jobs_keep_the_default_allocator(monkeypatch, world_size):
    calls = []
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: calls.append(name))
    assert host_memory.reuse_freed_host_memory(world_size) is False
    assert calls == []  # not even looked up


def test_one_process_applies_it_where_glibc_is():
    if ctypes.util.find_library("c") is None:
        pytest.skip("no C library to configure")
    assert host_memory.reuse_freed_host_memory(1) is True
