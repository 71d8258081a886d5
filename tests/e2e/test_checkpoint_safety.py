"""Resuming and sampling from damaged, tampered or mismatched checkpoints, through the CLI.

Each case: one line on stderr (a warning naming the file when an older intact checkpoint is
used; `moetrain: error:` and exit 2 when none is, or when the job differs from the checkpoint's),
never a traceback, never code from a crafted pickle. References: the losses the run logged before
the damage, and a marker file that only an unpickler running the crafted bytes could create.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

from moetrain import cli
from moetrain.checkpoint.layout import MANIFEST_FILE, META_FILE, TENSORS_DIR
from moetrain.commands.sample import main as sample_main


class _MakesMarker:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def _tensor_file(step_dir: Path) -> Path:
    (path,) = (step_dir / TENSORS_DIR).glob("*.safetensors")
    return path


def _list_in_manifest(step_dir: Path, name: str) -> None:
    manifest = json.loads((step_dir / MANIFEST_FILE).read_text())
    data = (step_dir / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (step_dir / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_a_damaged_newest_checkpoint_falls_back_with_one_warning(job_args, read_train_records, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["train", *job_args(run_dir, train__steps=4, checkpoint__every=2, train__eval_every=0)]) == 0
    before = read_train_records(run_dir)
    step4 = run_dir / "checkpoints" / "step_00000004"
    shard = _tensor_file(step4)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # one bit of one weight: still a valid file, silently different training before
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli.main(["train", *job_args(run_dir, train__steps=4, checkpoint__every=2, train__eval_every=0,
                                        checkpoint__resume=True)]) == 0
    warnings = [line for line in _lines(capsys.readouterr().err) if "skipping a damaged checkpoint" in line]
    assert len(warnings) == 1 and str(shard) in warnings[0] and "resuming from step_00000002" in warnings[0]
    after = read_train_records(run_dir)
    # Steps 3 and 4 were recomputed from step 2: the same losses as before the damage.
    for step in (3, 4):
        assert (after[step]["loss"], after[step]["grad_norm"]) == (before[step]["loss"], before[step]["grad_norm"])

    # Every checkpoint damaged: one error line, exit 2, nothing written.
    for step_dir in (run_dir / "checkpoints").iterdir():
        (step_dir / META_FILE).write_text("{}")
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    assert cli.main(["train", *job_args(run_dir, train__steps=6, checkpoint__resume="auto")]) == 2
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("moetrain: error: no intact checkpoint to resume from")
    assert "step_00000004/meta.json has 2 bytes, the manifest says" in lines[0]
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


def test_a_crafted_pickle_does_not_run_through_train_or_sample(job_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    marker = tmp_path / "code-ran"
    assert cli.main(["train", *job_args(run_dir, train__steps=2, checkpoint__every=2, train__eval_every=0)]) == 0
    step2 = run_dir / "checkpoints" / "step_00000002"
    crafted = pickle.dumps(_MakesMarker(marker))
    # Where torch's own checkpoint format would unpickle: its metadata file and a torch.save'd
    # file, listed in the manifest as someone who rewrote the directory would.
    for name in (".metadata", f"{TENSORS_DIR}/.metadata", f"{TENSORS_DIR}/__0_0.distcp", "extra.pt"):
        (step2 / name).write_bytes(crafted)
        _list_in_manifest(step2, name)
    capsys.readouterr()
    assert sample_main(["--run", str(run_dir), "--max-tokens", "4"]) == 0
    assert "step 2, greedy" in capsys.readouterr().out
    assert cli.main(["train", *job_args(run_dir, train__steps=3, checkpoint__every=2, train__eval_every=0,
                                        checkpoint__resume=True, checkpoint__allow_schedule_change=True)]) == 0
    assert not marker.exists()
    capsys.readouterr()
    # Outside the manifest, the same file makes a checkpoint damaged: with both damaged, sample
    # names the newest one's bad file and stops.
    for step_dir in (run_dir / "checkpoints").iterdir():
        (step_dir / "unlisted.pkl").write_bytes(crafted)
    assert cli.main(["sample", "--run", str(run_dir)]) == 2
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[-1].startswith("moetrain: error: ") and lines[-1].endswith(
        "step_00000003/unlisted.pkl is not in the checkpoint's manifest")
    assert not marker.exists()


def test_resume_modes_and_config_mismatches_are_one_line(job_args, read_train_records, tmp_path, capsys):
    run_dir = tmp_path / "run"
    short = {"train__eval_every": 0, "checkpoint__every": 2}
    # true needs a checkpoint; "auto" starts fresh without one, and resumes once there is one.
    assert cli.main(["train", *job_args(run_dir, train__steps=2, checkpoint__resume=True, **short)]) == 2
    assert "has no checkpoint" in _lines(capsys.readouterr().err)[0]
    assert not run_dir.exists()
    assert cli.main(["train", *job_args(run_dir, train__steps=2, checkpoint__resume="auto", **short)]) == 0
    assert cli.main(["train", *job_args(run_dir, train__steps=4, checkpoint__resume="auto", **short)]) == 2
    assert "train.steps = 4 differs from 2" in _lines(capsys.readouterr().err)[-1]  # the schedule would stretch
    assert cli.main(["train", *job_args(run_dir, train__steps=4, checkpoint__resume="auto",
                                        checkpoint__allow_schedule_change=True, **short)]) == 0
    events = [json.loads(line).get("event") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e for e in events if e] == ["start", "resume"] and sorted(read_train_records(run_dir)) == [1, 2, 3, 4]
    capsys.readouterr()
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    cases = {"model.dim = 64 differs from 32": {"model__dim": 64},
             "model.moe.n_experts = 8 differs from 4": {"model__moe__n_experts": 8},
             "model.n_layers = 3 differs from 2": {"model__n_layers": 3},
             "train.seed = 5 differs from 0": {"train__seed": 5},
             "data.seq_len = 16 differs from 32": {"data__seq_len": 16, "model__max_seq_len": 32}}
    for expected, overrides in cases.items():
        assert cli.main(["train", *job_args(run_dir, train__steps=6, checkpoint__resume=True, **overrides)]) == 2
        lines = _lines(capsys.readouterr().err)
        assert len(lines) == 1 and lines[0].startswith("moetrain: error: ") and expected in lines[0], lines
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
