"""Shared pieces of the end-to-end trainer tests: a small text corpus and a tiny job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stdlib_corpus import copy_stdlib_modules, tiny_moe_args

# Small, stable standard-library modules: real Python text, a few KB each.
CORPUS_MODULES = ["bisect.py", "colorsys.py", "keyword.py", "this.py", "stat.py", "glob.py", "fnmatch.py",
                  "genericpath.py", "nturl2path.py", "opcode.py", "copyreg.py", "struct.py"]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    return copy_stdlib_modules(tmp_path_factory.mktemp("corpus"), CORPUS_MODULES)


def tiny_job_args(corpus: Path, run_dir: Path, **overrides: object) -> list[str]:
    """A job small enough for a few seconds per run on a loaded CPU: 2 layers (1 dense, 1 MoE)."""
    fields: dict[str, object] = {
        "model.dim": 32, "model.n_layers": 2, "model.n_heads": 2, "model.ffn_hidden": 64, "model.max_seq_len": 32,
        "model.moe.n_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 16,
        "data.source": "dir", "data.path": str(corpus), "data.glob": "*.py", "data.seq_len": 32,
        "data.heldout_fraction": 0.2,
        "train.steps": 6, "train.microbatch_size": 2, "train.grad_accum": 2, "train.warmup_steps": 2,
        "train.eval_every": 3, "train.eval_batches": 2, "train.sample_tokens": 0, "train.num_threads": 1,
        "checkpoint.every": 3, "checkpoint.keep_last": 3,
        "logging.run_dir": str(run_dir), "logging.log_every": 1, "logging.progress_bar": False,
    }
    fields.update({k.replace("__", "."): v for k, v in overrides.items()})
    if "train__warmup_steps" not in overrides:  # warm-up must end before the run does
        fields["train.warmup_steps"] = min(2, int(fields["train.steps"]) - 1)  # type: ignore[call-overload]
    return tiny_moe_args(fields)


def train_records(run_dir: Path) -> dict[int, dict]:
    """step -> the last 'train' record of that step in the run's metrics file."""
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            records[record["step"]] = record
    return records


@pytest.fixture
def job_args(corpus_dir):
    """job_args(run_dir, **overrides) -> argv of the tiny job on the small corpus (`a__b=v` sets --a.b v)."""
    return lambda run_dir, **overrides: tiny_job_args(corpus_dir, run_dir, **overrides)


@pytest.fixture
def read_train_records():
    return train_records
