"""`moetrain data prepare --out`: never writes into a directory that is not its own, one line for every failed write.

References: a snapshot of the directory (names, sizes, mtimes) before and after, the CLI's exit status and
its stderr; a real full file system (a tmpfs, where one can be mounted).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from moetrain import cli
from moetrain.data import corpus
from moetrain.data.shards import MANIFEST


@pytest.fixture
def texts(tmp_path) -> Path:
    root = tmp_path / "texts"
    root.mkdir()
    for i in range(6):
        (root / f"doc{i}.txt").write_text(f"document {i} " * (50 + 20 * i), encoding="utf-8")
    return root


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _prepare(capsys, texts: Path, out: Path | str, *extra: str) -> tuple[int, str]:
    code = cli.main(["data", "prepare", "--quiet", "--input", str(texts), "--out", str(out), *extra])
    err = capsys.readouterr().err
    return code, err


def _one_line_refusal(code: int, err: str, *names: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("moetrain: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert all(name in lines[0] for name in names), lines[0]


def _checkpoint_like(root: Path) -> None:
    (root / "tensors").mkdir(parents=True)
    (root / "tensors" / "shard-00001.safetensors").write_bytes(b"\0" * 64)
    (root / MANIFEST).write_text(json.dumps({"format": "moetrain-checkpoint-v2", "algorithm": "sha256", "files": {}}))


@pytest.mark.parametrize("case", ["checkpoint directory", "user files", "input directory", "inside the input",
                                  "a file", "below a file", "other json manifest"])
def test_prepare_refuses_an_out_that_is_not_its_own_and_changes_nothing(capsys, texts, tmp_path, case):
    out = tmp_path / "out"
    if case == "checkpoint directory":
        _checkpoint_like(out)
    elif case == "user files":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "input directory":
        out = texts
    elif case == "inside the input":
        out = texts / "shards"
    elif case == "a file":
        out.write_text("a file")
    elif case == "below a file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "out"
    elif case == "other json manifest":
        out.mkdir()
        (out / MANIFEST).write_text('{"name": "a web app"}')
    before, inputs_before = _snapshot(tmp_path), _snapshot(texts)
    code, err = _prepare(capsys, texts, out)
    _one_line_refusal(code, err, "--out")
    assert _snapshot(tmp_path) == before and _snapshot(texts) == inputs_before


def test_prepare_continues_into_its_own_unfinished_output(capsys, texts, tmp_path):
    out = tmp_path / "out"
    assert _prepare(capsys, texts, out, "--shard-mb", "0.0005")[0] == 0
    (out / MANIFEST).unlink()  # as if interrupted before the manifest
    (out / "train" / "shard_00001.json").unlink()
    assert _prepare(capsys, texts, out, "--shard-mb", "0.0005")[0] == 0
    assert (out / MANIFEST).is_file() and (out / "train" / "shard_00001.json").is_file()
    assert _prepare(capsys, texts, tmp_path / "empty_ok", "--shard-mb", "0.0005")[0] == 0


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0", "1e300"])
def test_shard_mb_must_be_finite_and_positive(capsys, texts, tmp_path, value):
    code, err = _prepare(capsys, texts, tmp_path / "out", "--shard-mb", value)
    _one_line_refusal(code, err, "--shard-mb")
    assert not (tmp_path / "out").exists()


def test_an_unwritable_out_is_one_line(capsys, texts, tmp_path):
    for out in ("/proc/moetrain-out", "/proc/self/moetrain-out"):
        code, err = _prepare(capsys, texts, out)
        _one_line_refusal(code, err, out)


@pytest.fixture
def small_fs(tmp_path):
    """Mount a tmpfs (root in a container; skipped otherwise); yields mount(size, read_only) -> path."""
    mounted = []

    def mount(size: str, read_only: bool = False) -> Path:
        point = tmp_path / f"fs{len(mounted)}"
        point.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        if shutil.which("mount") is None or subprocess.run(
                ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_read_only_out_is_one_line(capsys, texts, small_fs):
    read_only = small_fs("1m", read_only=True)
    code, err = _prepare(capsys, texts, read_only / "out")
    _one_line_refusal(code, err, str(read_only / "out"))


def test_a_full_disk_is_one_line_and_the_rerun_continues(capsys, texts, tmp_path, small_fs):
    big = tmp_path / "big"
    big.mkdir()
    for i in range(8):
        (big / f"doc{i}.txt").write_text(("x" * 99 + "\n") * 2000, encoding="utf-8")  # 200 KB each
    full = small_fs("600k")
    out = full / "out"
    code, err = _prepare(capsys, big, out, "--shard-mb", "0.2", "--heldout-fraction", "0")
    _one_line_refusal(code, err, "no space left on device", str(out))
    finished = sorted(p.name for p in (out / "train").glob("shard_*.json"))
    assert finished and not (out / MANIFEST).exists()
    subprocess.run(["mount", "-o", "remount,size=4m", str(full)], check=True)
    assert _prepare(capsys, big, out, "--shard-mb", "0.2", "--heldout-fraction", "0")[0] == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["train_documents"] == 8


def test_a_dangling_link_in_a_data_directory_is_named_in_a_warning(tmp_path, caplog):
    (tmp_path / "real.txt").write_text("text")
    os.symlink(tmp_path / "gone.txt", tmp_path / "link.txt")
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        files = corpus.files_under(tmp_path, "*")
    assert files == [tmp_path / "real.txt"]
    assert any("link.txt" in r.getMessage() and "dangling" in r.getMessage() for r in caplog.records)
