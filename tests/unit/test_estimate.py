"""`moetrain estimate` and `moetrain config --from-hf`: the per-rank parts against the model itself and
the existing estimate, the mesh options, bad options as one line, and a TOML that loads back as the job."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import hf_tiny
from moetrain import cli
from moetrain.config.job import from_dict, parse_job_args
from moetrain.interop import hf_job_config
from moetrain.model.memory_estimate import estimate_training_memory, training_memory_breakdown
from moetrain.model.transformer import Transformer

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_moe.toml")
SMALL = ["--config", TINY, "--data.seq_len", "64", "--train.microbatch_size", "2", "--model.n_layers", "3"]


@pytest.mark.parametrize("shard", [1, 4])
def test_parts_are_the_models_parameters_and_the_estimates_activations(shard):
    cfg = parse_job_args(SMALL)
    numel = sum(p.numel() for p in Transformer(cfg.model).parameters())
    parts = training_memory_breakdown(cfg, shard)
    assert abs(parts.weights - 4 * numel / shard) < 4 and parts.gradients == parts.weights
    assert parts.optimizer == 2 * parts.weights
    for ac in (False, True):
        with_ac = parse_job_args([*SMALL, "--train.activation_checkpointing", str(ac)])
        assert parts.peak(ac) == estimate_training_memory(with_ac, shard).total
    assert parts.activations_checkpointed < parts.activations


def test_estimate_for_a_mesh_this_machine_does_not_have(capsys):
    assert cli.main(["estimate", *SMALL, "--nodes", "2", "--gpus-per-node", "4", "--device", "H100"]) == 0
    out = capsys.readouterr().out
    assert "8 rank(s) (1 replica(s) x 8 shard(s), ep 1), 4 per machine, device H100" in out
    assert "fits on H100" in out and "with activation checkpointing" in out
    assert cli.main(["estimate", *SMALL, "--world", "4", "--parallel.dp_replicate", "2"]) == 0
    assert "4 rank(s) (2 replica(s) x 2 shard(s)" in capsys.readouterr().out
    assert cli.main(["estimate", *SMALL, "--model.dim", "8192", "--model.n_layers", "64", "--device", "L4"]) == 0
    assert "does NOT fit on L4" in capsys.readouterr().out


@pytest.mark.parametrize("extra,needle", [
    (["--nodes", "2"], "--nodes and --gpus-per-node go together"),
    (["--device", "tpu"], "--device = 'tpu' is invalid"),
    (["--world", "0"], "--world = '0' is invalid"),
    (["--world", "3", "--parallel.dp_replicate", "2"], "must divide the data-parallel world size 3"),
])
def test_bad_estimate_options_are_one_line(extra, needle, capsys):
    assert cli.main(["estimate", *SMALL, *extra]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], lines


def test_config_from_hf_is_a_fine_tuning_job_of_the_directory_with_its_data_to_fill_in(tmp_path, capsys):
    directory = hf_tiny.save(hf_tiny.build("qwen3_moe"), tmp_path / "qwen3")
    assert cli.main(["config", "--from-hf", str(directory)]) == 0
    text = capsys.readouterr().out
    assert "# Model (residual stream) width.\ndim = 32" in text
    job = tomllib.loads(text)
    assert from_dict(job).model == hf_job_config(directory).model
    assert job["logging"]["run_dir"] == "runs/qwen3"  # not the default job's runs/tiny_moe
    assert (job["train"]["lr"], job["train"]["schedule"], job["train"]["sample_tokens"]) == (1e-4, "cosine", 0)
    assert job["train"]["sample_prompt"] == "" and (job["data"]["source"], "path" in job["data"]) == ("tokens", False)
    (tmp_path / "job.toml").write_text(text)
    assert cli.main(["train", "--config", str(tmp_path / "job.toml")]) == 2  # the data section, first
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.path = None is invalid: a path is required" in err[0], err
