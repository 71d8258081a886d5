"""Bad config and bad data: one line on stderr, exit status 2, existing checkpoints and metrics untouched."""

from __future__ import annotations

import hashlib
from pathlib import Path

from moetrain import cli


def _snapshot(run_dir: Path) -> dict[str, tuple[int, int, str]]:
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns,
                                          hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_bad_config_and_bad_data_leave_the_run_untouched(job_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["train", *job_args(run_dir, train__steps=2, checkpoint__every=2, train__eval_every=0)]) == 0
    before = _snapshot(run_dir)
    assert any(name.startswith("checkpoints/step_00000002/") for name in before)
    capsys.readouterr()

    bad_utf8 = tmp_path / "bad_utf8"
    bad_utf8.mkdir()
    (bad_utf8 / "ok.py").write_text("x = 1\n")
    (bad_utf8 / "latin1.py").write_bytes(b"s = 'caf\xe9'\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    resume = {"checkpoint__resume": True}
    cases = {
        "train.lr = -1.0 is invalid": job_args(run_dir, train__lr=-1, **resume),
        "unknown option --train.bogus": job_args(run_dir, **resume) + ["--train.bogus", "1"],
        "'latin1.py' is not UTF-8 text": job_args(run_dir, data__path=bad_utf8, **resume),
        "has no files matching": job_args(run_dir, data__path=empty, **resume),
        "already has checkpoints": job_args(run_dir),
        "must divide the data-parallel world size 1": job_args(run_dir, parallel__dp_replicate=2, **resume),
        "does not exist": ["--config", str(tmp_path / "missing.toml")],
        "model.vocab_size = 100 is invalid": job_args(run_dir, model__vocab_size=100, **resume),
    }
    for expected, argv in cases.items():
        assert cli.main(["train", *argv]) == 2, expected
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("moetrain: error: ") and expected in lines[0], (expected, err)
        assert _snapshot(run_dir) == before, expected
