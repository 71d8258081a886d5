"""The issue-28 cases that need a training run: the fallback-then-save scenario end to end, superseded metrics,
and the outputs of `plot` and `export-hf`, the address-space limit, token_budget under packed batching.

References: the directories and files on disk, the exit status and stderr of the CLI, a metrics file read
line by line.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from moetrain import cli
from moetrain.checkpoint.layout import TENSORS_DIR, latest_complete, list_complete
from moetrain.errors import ConfigError
from moetrain.interop import check_output_dir
from moetrain.observe.plot import read_records

REPO = Path(__file__).resolve().parents[2]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("moetrain: error:")]


def _one_line(code: int, err: str, *names: str) -> str:
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert all(name in lines[0] for name in names), lines[0]
    return lines[0]


def _damage_newest(run_dir: Path) -> Path:
    newest = latest_complete(run_dir / "checkpoints")
    (shard,) = (newest.path / TENSORS_DIR).glob("*.safetensors")
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    return newest.path


def test_a_save_below_a_damaged_checkpoint_keeps_one_to_resume_from(job_args, tmp_path, capsys):
    """The issue's scenario: keep_last 1, fell back to step 2 past a damaged step 4, saved step 3."""
    run_dir = tmp_path / "run"
    common = dict(train__eval_every=0, checkpoint__keep_last=1)
    # The same schedule throughout (6 steps); the first invocation stops after step 4.
    assert cli.main(["train", *job_args(run_dir, train__steps=6, train__stop_at_step=4, checkpoint__every=2,
                                        checkpoint__keep_last=2, train__eval_every=0)]) == 0
    _damage_newest(run_dir)
    assert cli.main(["train", *job_args(run_dir, train__steps=6, checkpoint__every=3, train__stop_at_step=3,
                                        checkpoint__resume=True, **common)]) == 0
    steps = [ref.step for ref in list_complete(run_dir / "checkpoints")]
    assert steps == [2, 3], steps  # the damaged 4 went; 2 (resumed from) and 3 (just written) stay
    capsys.readouterr()
    assert cli.main(["train", *job_args(run_dir, train__steps=6, checkpoint__every=3, checkpoint__resume=True,
                                        **common)]) == 0
    assert "skipping a damaged checkpoint" not in capsys.readouterr().err
    assert [ref.step for ref in list_complete(run_dir / "checkpoints")] == [3, 6]
    # One history: each train step once among the records that are not marked superseded.
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    current = [r["step"] for r in lines if r["kind"] == "train" and not r.get("superseded")]
    assert current == [1, 2, 3, 4, 5, 6], current
    superseded = sorted(r["step"] for r in lines if r["kind"] == "train" and r.get("superseded"))
    assert superseded == [3, 4], superseded  # the first run's steps past the checkpoint it fell back to
    assert [r["step"] for r in read_records(run_dir / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]


def _metrics_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [{"kind": "train", "step": s, "loss": 5.0 - s, "tokens_per_s": 100.0} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


@pytest.mark.parametrize("where", ["/proc/moetrain.png", "file/below.png", "a_dir.png", "curve.notaformat",
                                   "/proc/self/x.png"])
def test_plot_out_that_cannot_be_written_is_one_line(tmp_path, capsys, where):
    run_dir = _metrics_run(tmp_path)
    (tmp_path / "file").write_text("x")
    (tmp_path / "a_dir.png").mkdir()  # a directory where the file should go
    out = where if where.startswith("/") else str(tmp_path / where)
    code = cli.main(["plot", str(run_dir), "--out", out])
    _one_line(code, capsys.readouterr().err, "--out")


@pytest.mark.parametrize("where", ["/proc/moetrain-export", "file/below", "/proc/self/export"])
def test_export_out_that_cannot_be_written_is_one_line(tmp_path, where):
    (tmp_path / "file").write_text("x")
    out = where if where.startswith("/") else str(tmp_path / where)
    with pytest.raises(ConfigError) as err:
        check_output_dir(out)
    assert "--out" in str(err.value) and "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probe left nothing


def test_a_job_over_the_address_space_limit_is_one_line_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    # About 3.9 GiB estimated: within this machine's memory, beyond a 2.5 GB address-space limit.
    args = ["train", "--config", str(REPO / "configs" / "tiny_moe.toml"), "--model.dim", "1024", "--model.n_layers",
            "8", "--model.n_heads", "8", "--model.moe.n_experts", "8", "--model.moe.expert_hidden", "1024",
            "--train.steps", "2", "--train.warmup_steps", "1", "--logging.run_dir", str(run_dir),
            "--logging.progress_bar", "False"]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2_500_000_000, resource.RLIM_INFINITY))

    done = subprocess.run([sys.executable, "-m", "moetrain", *args], capture_output=True, text=True, timeout=300,
                          preexec_fn=limit, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    _one_line(done.returncode, done.stderr, "address-space limit", "RLIMIT_AS")
    assert not run_dir.exists()


def test_token_budget_under_packed_batching_is_one_line(job_args, tmp_path, capsys):
    code = cli.main(["train", *job_args(tmp_path / "run", data__token_budget=16)])
    _one_line(code, capsys.readouterr().err, "data.token_budget = 16", "data.batching")
    assert not (tmp_path / "run").exists()
