"""A new user's first fine-tune, typed as the docs say: a Hugging Face Qwen3-MoE directory, a TOML with
training settings only, `moetrain train --model.init_from hf:DIR`, the export under torchrun on 2 ranks,
and transformers' `from_pretrained` on the result. Every step is a real command line in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_tiny
from moetrain.checkpoint.layout import latest_complete
from moetrain.checkpoint.storage import load_model_weights
from moetrain.model.transformer import Transformer
from moetrain.runtime.run_dir import RunDir

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")

TRAINING_ONLY_TOML = """\
[data]
source = "dir"
path = "{corpus}"
glob = "*.py"
seq_len = 32
heldout_fraction = 0.2

[train]
steps = 3
warmup_steps = 1
microbatch_size = 2
eval_every = 0
eval_batches = 1
sample_tokens = 0
num_threads = 1

[checkpoint]
every = 3

[logging]
run_dir = "{run_dir}"
progress_bar = false
log_every = 1
"""


def _command(command: list[str], timeout_s: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # own session: a hang kills torchrun and its ranks too
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{command[:4]} did not finish within {timeout_s:g} s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH next to this interpreter")
def test_fine_tune_hf_directory_with_training_only_toml_then_export_under_torchrun(corpus_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_model = hf_tiny.build("qwen3_moe", seed=3)
    directory = hf_tiny.save(hf_model, tmp_path / "qwen3")
    run_dir, out = tmp_path / "run", tmp_path / "export"
    toml = tmp_path / "finetune.toml"
    toml.write_text(TRAINING_ONLY_TOML.format(corpus=corpus_dir, run_dir=run_dir))
    assert "[model]" not in toml.read_text()

    trained = _command([sys.executable, "-m", "moetrain", "train", "--config", str(toml),
                        "--model.init_from", f"hf:{directory}"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert trained.stdout.startswith("moetrain train: starting"), trained.stdout[:300]
    stored = json.loads((run_dir / "config.json").read_text())
    # The architecture and the tokenizer came from the directory, the training settings from the TOML.
    assert stored["model"]["dim"] == 32 and stored["model"]["head_dim"] == 12 and stored["model"]["n_kv_heads"] == 2
    assert stored["model"]["moe"]["n_experts"] == 6 and stored["model"]["qk_norm"] == "per_head"
    assert stored["data"]["tokenizer"] == str(directory) and stored["train"]["steps"] == 3

    exported = _command([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "moetrain", "export-hf",
                         "--run-dir", str(run_dir), "--out", str(out)])
    assert exported.returncode == 0, exported.stderr[-3000:]

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    cfg = RunDir(run_dir).load_config()
    ours = Transformer(cfg.model)
    ours.init_weights(seed=0)
    load_model_weights(latest_complete(RunDir(run_dir).checkpoints), ours)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, before = ours(tokens), loaded.eval()(tokens).logits, hf_model(tokens).logits
    assert hf_tiny.relative_error(got, want) < 1e-5  # the exported model is the trained one
    assert hf_tiny.relative_error(before, want) > 1e-4  # which 3 steps moved away from the start


def test_explicit_model_field_that_disagrees_with_the_directory_is_one_line(corpus_dir, tmp_path):
    directory = hf_tiny.save(hf_tiny.build("qwen3_moe", seed=3), tmp_path / "qwen3")
    toml = tmp_path / "finetune.toml"
    toml.write_text(TRAINING_ONLY_TOML.format(corpus=corpus_dir, run_dir=tmp_path / "run") + "\n[model]\ndim = 64\n")
    failed = _command([sys.executable, "-m", "moetrain", "train", "--config", str(toml),
                       "--model.init_from", f"hf:{directory}"])
    lines = [line for line in failed.stderr.splitlines() if line.startswith("moetrain: error:")]
    assert failed.returncode == 2 and len(lines) == 1, failed.stderr[-2000:]
    assert "model.dim = 64" in lines[0] and "hidden_size gives 32" in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_dry_run_validates_prints_the_job_and_estimate_and_writes_nothing(job_args, tmp_path, capsys):
    import tomllib

    from moetrain import cli
    from moetrain.config.job import from_dict, parse_job_args

    run_dir = tmp_path / "run"
    argv = job_args(run_dir)
    assert cli.main(["train", *argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert from_dict(tomllib.loads(out)).validate() == parse_job_args(argv)  # the resolved job, as TOML
    assert "# data: " in out and "#     peak " in out and "with activation checkpointing" in out
    assert not run_dir.exists()
    # It checks what a start checks: bad data is still the one-line error, before anything is written.
    assert cli.main(["train", *job_args(run_dir, data__path=tmp_path / "nowhere"), "--dry-run"]) == 2
    assert not run_dir.exists()


def test_a_refused_start_leaves_the_directory_as_it_was(job_args, tmp_path, capsys):
    import importlib.util

    from moetrain import cli

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("needs an environment without tensorboard (the refusal this test provokes)")
    run_dir = tmp_path / "run"
    assert cli.main(["train", *job_args(run_dir, train__steps=2, checkpoint__every=2, train__warmup_steps=1),
                     "--logging.tensorboard", "True"]) == 2
    assert "tensorboard" in capsys.readouterr().err
    assert not run_dir.exists()  # no config.json, no run.lock: the corrected command is not "another run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    assert cli.main(["train", *job_args(run_dir, train__steps=2, checkpoint__every=2, train__warmup_steps=1),
                     "--logging.tensorboard", "True"]) == 2
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
    assert cli.main(["train", *job_args(run_dir, train__steps=2, checkpoint__every=2, train__warmup_steps=1)]) == 0


def test_a_resume_that_would_change_the_schedule_is_one_line_unless_allowed(job_args, read_train_records, tmp_path,
                                                                            capsys):
    from moetrain import cli

    run_dir = tmp_path / "run"
    short = {"train__eval_every": 0, "checkpoint__every": 2, "train__warmup_steps": 1}
    assert cli.main(["train", *job_args(run_dir, train__steps=2, **short)]) == 0
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert cli.main(["train", *job_args(run_dir, train__steps=4, checkpoint__resume=True, **short)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines[-1].startswith("moetrain: error: train.steps = 4 differs from 2 in checkpoint") and \
        "--checkpoint.allow_schedule_change True" in lines[-1], lines
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert cli.main(["train", *job_args(run_dir, train__steps=4, checkpoint__resume=True,
                                        checkpoint__allow_schedule_change=True, **short)]) == 0
    assert sorted(read_train_records(run_dir)) == [1, 2, 3, 4]


def test_warmup_that_does_not_end_before_the_run_is_one_line(job_args, tmp_path, capsys):
    from moetrain import cli

    assert cli.main(["train", *job_args(tmp_path / "run", train__steps=3, train__warmup_steps=3)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == ["moetrain: error: train.warmup_steps = 3 is invalid: must be < train.steps = 3 (the schedule "
                     "would never leave warm-up)"], lines
