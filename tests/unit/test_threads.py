"""train.num_threads: a number is used as given; 0 uses every usable core unless a probe finds them busy."""

from __future__ import annotations

import pytest
import torch

from moetrain.runtime import threads


def _never_called(count: int) -> float:
    raise AssertionError("probed although the thread count was decided without it")


@pytest.mark.parametrize("requested", [1, 2, 3])
def test_an_explicit_count_is_used_without_probing(requested):
    assert threads.choose_threads(requested, cores=2, speedup=_never_called)[0] == requested


def test_one_core_needs_no_probe():
    assert threads.choose_threads(0, cores=1, speedup=_never_called) == (1, "one usable core")


@pytest.mark.parametrize("speedup, expected", [(1.9, 2), (1.3, 2), (1.29, 1), (1.0, 1), (0.4, 1)])
def test_all_cores_only_when_they_pay_off(speedup, expected):
    probed = []
    chosen, why = threads.choose_threads(0, cores=2, speedup=lambda count: probed.append(count) or speedup)
    assert (chosen, probed) == (expected, [2])
    assert f"{speedup:.2f}x" in why


def test_cores_are_shared_among_the_ranks_of_the_host(monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert threads.usable_cores() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert threads.usable_cores() == 1


def test_probe_measures_and_restores_the_thread_count():
    before = torch.get_num_threads()
    ratio = threads.probe_speedup(2, size=64, block_s=0.005, rounds=2)
    assert ratio > 0
    assert torch.get_num_threads() == before


def test_omp_num_threads_is_left_to_torch(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(threads, "probe_speedup", _never_called)
    before = torch.get_num_threads()
    assert threads.set_intra_op_threads(0) == f"{before} (OMP_NUM_THREADS)"
    assert torch.get_num_threads() == before


def test_applied_count_is_what_torch_uses(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(threads, "usable_cores", lambda: 3)
        monkeypatch.setattr(threads, "probe_speedup", lambda count: 2.5)
        assert threads.set_intra_op_threads(0).startswith("3 (3 usable cores")
        assert torch.get_num_threads() == 3
        monkeypatch.setattr(threads, "probe_speedup", lambda count: 1.1)
        assert threads.set_intra_op_threads(0).startswith("1 (3 usable cores but")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_resumed_run_takes_the_count_its_checkpoint_recorded(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(threads, "probe_speedup", _never_called)
        assert threads.set_intra_op_threads(0, interrupted=3).startswith("3 (the count the resumed checkpoint")
        assert torch.get_num_threads() == 3
        # An explicit count still wins over the recorded one.
        assert threads.set_intra_op_threads(1, interrupted=3) == "1 (train.num_threads)"
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
