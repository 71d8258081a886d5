"""Full-disk detection: ENOSPC found wherever a write failure carries it, other failures untouched."""

from __future__ import annotations

import errno
import shutil

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from moetrain.errors import ConfigError
from moetrain.runtime import disk
from moetrain.runtime.disk import find_full_disk_error, no_space_left


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
                                          r"\(No space left on device\); free space and run again"):
        with no_space_left("/x", "checkpoint"):
            raise CheckpointException("save failed", {0: _wrap_exception(_raised(
                OSError(errno.ENOSPC, "No space left on device", "/x/shard.distcp")))})
    with pytest.raises(ConfigError, match=r"writing the metrics file '/run/metrics.jsonl'"):
        with no_space_left("/run/metrics.jsonl", "metrics file"):
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(PermissionError):
        with no_space_left("/x", "checkpoint"):
            raise PermissionError(errno.EACCES, "Permission denied")



def test_a_failed_write_on_a_nearly_full_file_system_is_reported_as_full(monkeypatch):
    # torch.save into a full file system fails in its zip writer with a RuntimeError, no errno.
    zip_failure = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(disk, "free_bytes", lambda path: 0)
    with pytest.raises(ConfigError, match=r"^no space left on device writing the checkpoint '/run/checkpoints' "
                                          r"\(RuntimeError with 0 bytes free on its file system\)"):
        with no_space_left("/run/checkpoints", "checkpoint"):
            raise zip_failure
    monkeypatch.setattr(disk, "free_bytes", lambda path: 10 * 2**30)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        with no_space_left("/run/checkpoints", "checkpoint"):
            raise zip_failure
    monkeypatch.setattr(disk, "free_bytes", lambda path: 0)
    with pytest.raises(KeyboardInterrupt):  # never mistaken for a full disk
        with no_space_left("/run/checkpoints", "checkpoint"):
            raise KeyboardInterrupt


def test_free_bytes_looks_at_the_nearest_existing_parent(tmp_path):
    assert disk.free_bytes(tmp_path / "not" / "yet" / "there") == shutil.disk_usage(tmp_path).free
