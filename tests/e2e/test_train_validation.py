"""Configs and data folders a hostile user might pass: one correct line, exit 2, nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moetrain import cli


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moetrain: error: "), err
    return lines[0]


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("toml, expected", [
    ("[train]\nsteps = true\n", "train.steps = True has the wrong type: expected int"),
    ("[train]\nlr = inf\n", "train.lr = inf is invalid: must be a finite number"),
    ("[model.moe]\naux_loss_coef = inf\n", "model.moe.aux_loss_coef = inf is invalid: must be a finite number"),
    ("[train]\nmax_consecutive_skips = 0\n", "train.max_consecutive_skips = 0 is invalid"),
])
def test_bad_values_in_a_config_file(tmp_path, capsys, toml, expected):
    run_dir = tmp_path / "run"
    config = _config(tmp_path, toml + f"[logging]\nrun_dir = '{run_dir}'\n")
    assert cli.main(["train", "--config", str(config)]) == 2
    assert expected in _error_line(capsys.readouterr().err)
    assert not run_dir.exists()


def test_directory_and_unreadable_config(tmp_path, capsys, monkeypatch):
    assert cli.main(["train", "--config", str(tmp_path)]) == 2
    assert _error_line(capsys.readouterr().err).endswith(f"config file '{tmp_path}' is a directory; pass a TOML file")
    config = _config(tmp_path, "[train]\nsteps = 3\n")
    real_read_text = Path.read_text

    def read_text(self: Path, *args, **kwargs) -> str:
        # Permission bits do not stop root, so simulate the failure at the read itself.
        if self == config:
            raise PermissionError(13, "Permission denied")
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    assert cli.main(["train", "--config", str(config)]) == 2
    assert _error_line(capsys.readouterr().err).endswith(f"config file '{config}' is unreadable (Permission denied)")


def test_data_folder_with_a_non_utf8_name_and_a_symlink_loop(job_args, corpus_dir, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for source in sorted(corpus_dir.iterdir()):
        (data / source.name).write_bytes(source.read_bytes())
    (Path(os.fsdecode(bytes(data))) / os.fsdecode(b"r\xe9sum\xe9.py")).write_text("x = 1\n")
    (data / "loop.py").symlink_to("loop.py")
    run_dir = tmp_path / "run"
    assert cli.main(["train", *job_args(run_dir, data__path=data)]) == 2
    err = capsys.readouterr().err
    assert "skipping data file 'loop.py': it is a symbolic link loop" in err
    errors = [line for line in err.splitlines() if line.startswith("moetrain: error:")]
    assert errors == ["moetrain: error: data file name 'r\\xe9sum\\xe9.py' is not valid UTF-8; rename it, or set "
                      "--data.skip_bad_files True to skip such files"], err
    assert not run_dir.exists()
    argv = job_args(run_dir, data__path=data, data__skip_bad_files=True, train__steps=1, train__eval_every=0,
                    checkpoint__enabled=False)
    assert cli.main(["train", *argv]) == 0
    err = capsys.readouterr().err
    assert "skipping data file name 'r\\xe9sum\\xe9.py' is not valid UTF-8" in err, err
