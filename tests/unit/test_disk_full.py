"""Full-disk detection: ENOSPC found wherever a write failure carries it, other failures untouched."""

from __future__ import annotations

import errno

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from moetrain.errors import ConfigError
from moetrain.train.disk import find_full_disk_error, no_space_left


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as err:  # noqa: BLE001 - the test needs the traceback DCP wraps
        return err


def test_full_disk_is_found_directly_chained_and_inside_a_dcp_rank_failure():
    full = OSError(errno.ENOSPC, "No space left on device", "/x/shard.distcp")
    assert find_full_disk_error(full) is full
    chained = RuntimeError("write failed")
    chained.__cause__ = full
    assert find_full_disk_error(chained) is full
    dcp = CheckpointException("save failed", {1: _wrap_exception(_raised(full))})
    assert find_full_disk_error(dcp) is full
    assert find_full_disk_error(OSError(errno.EDQUOT, "Disk quota exceeded")) is not None
    assert find_full_disk_error(OSError(errno.EACCES, "Permission denied")) is None
    assert find_full_disk_error(CheckpointException("x", {0: _wrap_exception(_raised(KeyError("k")))})) is None


def test_no_space_left_names_the_failing_file_else_the_path_and_passes_other_errors():
    with pytest.raises(ConfigError, match=r"^no space left on device writing the checkpoint '/x/shard.distcp' "
                                          r"\(No space left on device\); free space"):
        with no_space_left("/x", "checkpoint"):
            raise CheckpointException("save failed", {0: _wrap_exception(_raised(
                OSError(errno.ENOSPC, "No space left on device", "/x/shard.distcp")))})
    with pytest.raises(ConfigError, match=r"writing the metrics file '/run/metrics.jsonl'"):
        with no_space_left("/run/metrics.jsonl", "metrics file"):
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(PermissionError):
        with no_space_left("/x", "checkpoint"):
            raise PermissionError(errno.EACCES, "Permission denied")

