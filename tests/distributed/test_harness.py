"""The multi-rank harness: results, failures, hangs and a DTensor round trip on gloo."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from moetrain.testing import RankFailure, run_on_ranks


def _all_reduce_rank_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item(), dist.get_rank(), dist.get_world_size()


def _raise_on_rank_two():
    if dist.get_rank() == 2:
        raise ValueError("deliberate failure on rank two")
    return dist.get_rank()


def _hang_on_rank_one():
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.barrier()


def _dtensor_uneven_round_trip():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(7 * 3, dtype=torch.float64).reshape(7, 3)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    return tuple(sharded.to_local().shape), bool(torch.equal(sharded.full_tensor(), full))


def _environment_variable(name):
    return os.environ.get(name)


def _print_and_multiply_on_threads():
    print(f"rank {dist.get_rank()} writes to the parent's stdout", flush=True)
    a = torch.randn(512, 512)
    return torch.get_num_threads(), bool(torch.allclose(a @ a, (a.double() @ a.double()).float(), atol=1e-3))


def test_ranks_start_with_the_given_environment_and_the_parent_keeps_its_own(monkeypatch):
    monkeypatch.delenv("MOETRAIN_HARNESS_PROBE", raising=False)
    seen = run_on_ranks(_environment_variable, 2, "MOETRAIN_HARNESS_PROBE",
                        rank_env={"MOETRAIN_HARNESS_PROBE": "on"})
    assert seen == ["on", "on"]
    assert "MOETRAIN_HARNESS_PROBE" not in os.environ
    assert run_on_ranks(_environment_variable, 2, "MOETRAIN_HARNESS_PROBE") == [None, None]


def test_ranks_see_the_environment_of_the_call_not_of_an_earlier_one(monkeypatch):
    monkeypatch.setenv("MOETRAIN_HARNESS_PROBE", "first")
    assert run_on_ranks(_environment_variable, 2, "MOETRAIN_HARNESS_PROBE") == ["first", "first"]
    monkeypatch.setenv("MOETRAIN_HARNESS_PROBE", "second")
    assert run_on_ranks(_environment_variable, 2, "MOETRAIN_HARNESS_PROBE") == ["second", "second"]


def test_ranks_write_to_the_callers_stdout_and_run_intra_op_threads(capfd):
    # Ranks forked from a server must not inherit a started thread pool (a parallel op would hang).
    results = run_on_ranks(_print_and_multiply_on_threads, 2, threads_per_rank=2, timeout=60)
    assert results == [(2, True), (2, True)]
    out = capfd.readouterr().out
    assert "rank 0 writes to the parent's stdout" in out and "rank 1 writes to the parent's stdout" in out


def test_four_rank_all_reduce():
    results = run_on_ranks(_all_reduce_rank_sum, 4, timeout=60)
    assert results == [(10.0, r, 4) for r in range(4)]


def test_rank_exception_fails_with_its_traceback():
    with pytest.raises(RankFailure, match=r"rank 2 raised:(.|\n)*deliberate failure on rank two"):
        run_on_ranks(_raise_on_rank_two, 4, timeout=60)


def test_hung_collective_fails_within_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="did not finish within"):
        run_on_ranks(_hang_on_rank_one, 2, timeout=3)  # a hang can only end as "did not finish"
    assert time.monotonic() - start < 30


def test_dtensor_uneven_shard_round_trip():
    results = run_on_ranks(_dtensor_uneven_round_trip, 4, timeout=60)
    # torch.chunk semantics: 7 rows over 4 ranks -> 2, 2, 2, 1
    assert [shape for shape, _ in results] == [(2, 3), (2, 3), (2, 3), (1, 3)]
    assert all(equal for _, equal in results)
