"""A full disk while writing metrics or a checkpoint: one line with "no space left" and the path, exit 2.

The disk is filled in-process: writes to the chosen files go through a file object that
stores half of the data, then raises OSError(ENOSPC) as a full file system does; and, where
a tmpfs can be mounted, on a really full file system.
"""

from __future__ import annotations

import errno
import json
import pathlib
import shutil
import subprocess
from pathlib import Path

import pytest

from moetrain import cli
from moetrain.checkpoint.layout import list_complete


class _FillsUp:
    """A file object that accepts half of the first write after `allowed_writes` writes, then ENOSPC."""

    def __init__(self, real, allowed_writes: int):
        self._real = real
        self._left = allowed_writes

    def write(self, data):
        if self._left <= 0:
            self._real.write(data[: len(data) // 2])
            self._real.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        self._left -= 1
        return self._real.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._real.close()
        return False

    def __getattr__(self, name):
        return getattr(self._real, name)


def _fill_disk(monkeypatch, matches, allowed_writes: int = 0) -> None:
    real_open = pathlib.Path.open

    def open_(self, mode="r", *args, **kwargs):
        handle = real_open(self, mode, *args, **kwargs)
        if any(c in mode for c in "wax") and matches(Path(self)):
            return _FillsUp(handle, allowed_writes)
        return handle

    monkeypatch.setattr(pathlib.Path, "open", open_)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("moetrain: error:")]
    assert len(lines) == 1, err
    return lines[0]


def _records_parse(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_full_disk_during_a_checkpoint_is_one_line(job_args, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    _fill_disk(monkeypatch, lambda p: "checkpoints" in p.parts)
    argv = job_args(run_dir, train__steps=4, checkpoint__every=2, train__eval_every=0)
    assert cli.main(["train", *argv]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "no space left on device writing the checkpoint" in line, line
    assert str(run_dir / "checkpoints") in line and "No space left on device" in line, line
    assert list_complete(run_dir / "checkpoints") == []
    assert max(r["step"] for r in _records_parse(run_dir)) == 2  # whole records up to the failed save


@pytest.mark.parametrize("allowed_writes", [0, 3])
def test_full_disk_while_writing_metrics_is_one_line_and_leaves_whole_records(job_args, tmp_path, monkeypatch,
                                                                              capsys, allowed_writes):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Each record opens the file anew: count the opens, not the writes inside one.
    opened = {"n": 0}
    real_open = pathlib.Path.open

    def open_(self, mode="r", *args, **kwargs):
        handle = real_open(self, mode, *args, **kwargs)
        if self.name == "metrics.jsonl" and "a" in mode:
            opened["n"] += 1
            if opened["n"] > allowed_writes:
                return _FillsUp(handle, 0)
        return handle

    monkeypatch.setattr(pathlib.Path, "open", open_)
    argv = job_args(run_dir, train__steps=4, checkpoint__every=2, train__eval_every=0)
    assert cli.main(["train", *argv]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "no space left on device writing the metrics file" in line, line
    assert str(run_dir / "metrics.jsonl") in line, line
    if allowed_writes == 0:  # the start record failed: the refused start left the directory as it was
        assert sorted(p.name for p in run_dir.iterdir()) == []
        return
    records = _records_parse(run_dir)  # the half-written record was cut off
    assert len(records) == allowed_writes


@pytest.fixture
def tiny_file_system(tmp_path):
    """A 2 MiB tmpfs (needs the right to mount, i.e. root in a container; skipped otherwise)."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_really_full_file_system_during_a_checkpoint(job_args, tiny_file_system, capsys):
    # Leave 64 KiB: room for the config and the metrics, not for the ~0.5 MB checkpoint. On a real
    # full disk torch.save fails inside its zip writer with a RuntimeError, not an ENOSPC OSError.
    filler = tiny_file_system / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(tiny_file_system).free - 64 * 1024))
    run_dir = tiny_file_system / "run"
    assert cli.main(["train", *job_args(run_dir, train__steps=2, checkpoint__every=2, train__eval_every=0)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"no space left on device writing the checkpoint '{run_dir / 'checkpoints'}'" in line, line
    assert list_complete(run_dir / "checkpoints") == []
    assert [r["step"] for r in _records_parse(run_dir) if r["kind"] == "train"] == [1, 2]
