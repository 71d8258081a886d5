"""The run directory's writer lock and the refusal to replace another run's config/metrics."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moetrain.config.job import JobConfig, from_dict
from moetrain.errors import ConfigError
from moetrain.runtime.run_dir import LOCK_FILE, RunDir, WriterLock, refuse_foreign_outputs


def test_a_second_lock_on_the_same_directory_is_refused_until_the_first_is_released(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    first = WriterLock(run_dir)
    first.acquire()
    (run_dir.root / "metrics.jsonl").write_text("{}\n")  # the run wrote something: the directory stays
    second = WriterLock(run_dir)
    with pytest.raises(ConfigError, match="is in use by another training run") as err:
        second.acquire()
    assert "logging.run_dir" in str(err.value) and "\n" not in str(err.value)
    first.release()
    second.acquire()
    second.release()
    assert (run_dir.root / LOCK_FILE).is_file() and (run_dir.root / "metrics.jsonl").is_file()


def test_a_lock_held_by_another_process_is_refused_and_dropped_when_it_is_killed(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(run_dir.lock)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match="is in use by another training run"):
            WriterLock(run_dir).acquire()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    lock = WriterLock(run_dir)  # the kernel released the killed holder's lock
    lock.acquire()
    lock.release()


def test_a_run_that_wrote_nothing_leaves_no_directory_behind(tmp_path):
    run_dir = RunDir(tmp_path / "a" / "run")
    lock = WriterLock(run_dir)
    lock.acquire()
    assert run_dir.lock.is_file()
    lock.release()
    assert not run_dir.root.exists()
    existing = RunDir(tmp_path / "existing")
    existing.root.mkdir()
    lock = WriterLock(existing)
    lock.acquire()
    lock.release()
    assert existing.root.is_dir()  # not created by the lock: left as it was (plus the lock file)


def test_a_fresh_run_refuses_another_runs_config_or_metrics(tmp_path):
    run_dir = RunDir(tmp_path)
    fresh = JobConfig().validate()
    refuse_foreign_outputs(run_dir, fresh)  # an empty directory is fine
    run_dir.metrics.write_text("{}\n")
    with pytest.raises(ConfigError, match=r"already holds metrics.jsonl of another run"):
        refuse_foreign_outputs(run_dir, fresh)
    run_dir.config.write_text("{}")
    with pytest.raises(ConfigError, match=r"already holds config.json and metrics.jsonl"):
        refuse_foreign_outputs(run_dir, fresh)
    refuse_foreign_outputs(run_dir, from_dict({"checkpoint": {"resume": True}}).validate())
    refuse_foreign_outputs(run_dir, from_dict({"checkpoint": {"resume": "auto"}}).validate())


@pytest.mark.parametrize("section, name, value", [
    ("parallel", "collective_timeout_s", 0.0), ("parallel", "collective_timeout_s", float("inf")),
    ("parallel", "collective_timeout_s", -5.0), ("checkpoint", "signal_save_after_s", -1.0),
    ("checkpoint", "signal_save_after_s", float("inf")),
])
def test_timeouts_must_be_finite_and_positive(section, name, value):
    with pytest.raises(ConfigError, match=rf"{section}.{name} = .* is invalid"):
        from_dict({section: {name: value}}).validate()


def test_a_run_directory_named_by_a_string_joins_paths_like_one_named_by_a_path(tmp_path):
    named = RunDir(str(tmp_path / "run"))
    assert named == RunDir(tmp_path / "run")
    assert named.checkpoints == tmp_path / "run" / "checkpoints" and named.lock == tmp_path / "run" / LOCK_FILE
