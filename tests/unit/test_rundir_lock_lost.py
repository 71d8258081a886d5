"""A run.lock deleted while its run trains, and the lock file a refused run leaves (none).

The reference is the file system itself: which file is at RUN_DIR/run.lock, who can flock it (another
WriterLock, or a process of its own), and the directory's entries before and after.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moetrain import cli
from moetrain.errors import ConfigError
from moetrain.runtime.run_dir import RunDir, WriterLock


def _entries(root):
    return sorted((p.name, p.stat().st_size) for p in root.iterdir())


def test_a_deleted_lock_nobody_took_is_taken_again(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    lock = WriterLock(run_dir)
    lock.acquire()
    run_dir.metrics.write_text("{}\n")
    run_dir.lock.unlink()
    lock.check_held()
    assert run_dir.lock.is_file()
    with pytest.raises(ConfigError, match="is in use by another training run"):
        WriterLock(run_dir).acquire()  # the new file is held
    lock.release()


def test_a_writer_whose_lock_another_run_took_stops_in_one_line(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    first = WriterLock(run_dir)
    first.acquire()
    run_dir.metrics.write_text("{}\n")
    run_dir.lock.unlink()  # deleted by hand while the first run trains
    second = WriterLock(run_dir)
    second.acquire()  # the documented limit: nothing stops the second run from starting
    with pytest.raises(ConfigError) as err:
        first.check_held()
    text = str(err.value)
    assert "\n" not in text and "run.lock was removed" in text and "another training run holds it" in text
    first.release()
    assert run_dir.lock.is_file()  # the second run's file: the first must not remove it
    with pytest.raises(ConfigError, match="is in use by another training run"):
        WriterLock(run_dir).acquire()
    second.release()


def test_a_refused_run_leaves_no_lock_file_in_an_existing_directory(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / "notes.txt").write_text("the user's")
    before = _entries(root)
    lock = WriterLock(RunDir(root))
    lock.acquire()
    lock.release()
    assert _entries(root) == before
    # A run that wrote something keeps its lock file (the documented behaviour).
    lock = WriterLock(RunDir(root))
    lock.acquire()
    (root / "metrics.jsonl").write_text("{}\n")
    lock.release()
    assert (root / "run.lock").is_file()


def test_a_refused_fresh_training_run_leaves_the_directory_as_it_was(tmp_path, capsys):
    root = tmp_path / "run"
    root.mkdir()
    (root / "config.json").write_text("{}")  # another run's: a fresh run is refused
    before = _entries(root)
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe.toml"
    code = cli.main(["train", "--config", str(config), "--logging.run_dir", str(root), "--train.steps", "1",
                     "--train.warmup_steps", "0",
                     "--logging.progress_bar", "False"])
    err = capsys.readouterr().err
    assert code == 2 and "already holds config.json" in err and "Traceback" not in err, err
    assert _entries(root) == before


def test_a_lock_held_by_a_live_process_after_deletion_is_detected(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    lock = WriterLock(run_dir)
    lock.acquire()
    run_dir.metrics.write_text("{}\n")
    run_dir.lock.unlink()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, time\n"
        f"fd = os.open({str(run_dir.lock)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(600)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match="another training run holds it now"):
            lock.check_held()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
        lock.release()
