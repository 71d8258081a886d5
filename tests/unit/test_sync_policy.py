"""Sync policies as data: the flag table, "auto" resolution, and the accumulation iterator's positions."""

import pytest

from moetrain.config.parallel import ParallelConfig
from moetrain.errors import ConfigError
from moetrain.parallel.grad_sync import SYNC_POLICIES, SyncFlags, accumulation, resolve_sync_policy
from moetrain.parallel.mesh import MeshDims


class _Plain:
    """A model without FSDP units: the iterator must still work (flags are a no-op)."""

    def modules(self):
        return iter(())


def test_table_flags_per_position():
    # (requires_gradient_sync, requires_all_reduce) for (not last, last)
    expected = {
        "every_microbatch": ((True, True), (True, True)),
        "delayed_all_reduce": ((True, False), (True, True)),
        "final_only": ((False, False), (True, True)),
    }
    got = {name: ((p.not_last.requires_gradient_sync, p.not_last.requires_all_reduce),
                  (p.last.requires_gradient_sync, p.last.requires_all_reduce)) for name, p in SYNC_POLICIES.items()}
    assert got == expected
    assert all(p.flags(True) == SyncFlags(True, True) for p in SYNC_POLICIES.values())


@pytest.mark.parametrize("shape,accum,expected", [
    ((2, 2), 4, "delayed_all_reduce"),   # HSDP with accumulation
    ((4, 1), 2, "delayed_all_reduce"),   # pure replication with accumulation
    ((2, 2), 1, "every_microbatch"),     # nothing to delay
    ((1, 4), 8, "every_microbatch"),     # FSDP: no replicate all-reduce to delay
    ((1, 1), 8, "every_microbatch"),     # unsharded single process
])
def test_auto_resolution(shape, accum, expected):
    dims = MeshDims(dp_replicate=shape[0], dp_shard=shape[1])
    assert resolve_sync_policy(ParallelConfig(sync_policy="auto"), dims, accum).name == expected


@pytest.mark.parametrize("name", sorted(SYNC_POLICIES))
def test_explicit_policy_is_kept(name):
    assert resolve_sync_policy(ParallelConfig(sync_policy=name), MeshDims(dp_replicate=2, dp_shard=2), 4).name == name


def test_unknown_policy_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match="parallel.sync_policy = 'sometimes'") as err:
        resolve_sync_policy(ParallelConfig(sync_policy="sometimes"), MeshDims(), 2)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("source", [list, iter, tuple])
def test_accumulation_marks_only_the_last(source):
    items = source(["a", "b", "c"])
    assert list(accumulation(_Plain(), items, SYNC_POLICIES["final_only"])) == [
        ("a", False), ("b", False), ("c", True)]


def test_accumulation_single_and_empty():
    policy = SYNC_POLICIES["delayed_all_reduce"]
    assert list(accumulation(_Plain(), ["only"], policy)) == [("only", True)]
    assert list(accumulation(_Plain(), [], policy)) == []
