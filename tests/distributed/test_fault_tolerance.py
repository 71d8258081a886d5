"""Fault-tolerant HSDP through torchft: a real lighthouse process and two replica groups of 2 gloo ranks.

Each group is its own `torchrun --standalone` job (FSDP over its 2 ranks); the groups sum their
gradients in torchft's managed group. Without a fault the groups train exactly what one process
trains on the same global batch (and so plain HSDP 2 x 2). When one group is SIGKILLed, the other
keeps stepping (same processes) with the loss divided by its own tokens only; the killed group,
restarted, copies the live group's state and from then on both hold bitwise-equal parameters.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from moetrain.data.corpus import stdlib_root
from moetrain.testing.replica_groups import TORCHRUN, Lighthouse, ReplicaGroupJob, read_records
from moetrain.train import run

CORPUS = ["bisect.py", "colorsys.py", "keyword.py", "this.py", "stat.py", "glob.py", "fnmatch.py", "genericpath.py"]
MICRO, ACCUM, GROUP_RANKS = 2, 2, 2
pytestmark = pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not next to this interpreter")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ft_corpus")
    for name in CORPUS:
        shutil.copyfile(stdlib_root() / name, root / name)
    return root


def job_args(corpus: Path, run_dir: Path, **fields: object) -> list[str]:
    """A tiny aux-loss-free MoE job (1 dense + 1 MoE layer); `a__b=v` sets --a.b v."""
    values: dict[str, object] = {
        "model.dim": 32, "model.n_layers": 2, "model.n_heads": 2, "model.ffn_hidden": 64, "model.max_seq_len": 32,
        "model.moe.n_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 16,
        "model.moe.load_balance": "aux_free",
        "data.source": "dir", "data.path": str(corpus), "data.glob": "*.py", "data.seq_len": 32,
        "data.heldout_fraction": 0.0, "train.microbatch_size": MICRO, "train.grad_accum": ACCUM,
        "train.warmup_steps": 1, "train.eval_every": 0, "train.sample_tokens": 0, "train.num_threads": 1,
        "checkpoint.every": 1000, "logging.run_dir": str(run_dir), "logging.log_every": 1,
        "logging.progress_bar": False,
    }
    values.update({k.replace("__", "."): v for k, v in fields.items()})
    args = ["--config", str(Path(__file__).resolve().parents[2] / "configs" / "tiny_moe.toml")]
    for key, value in values.items():
        args += [f"--{key}", str(value)]
    return args


def group_args(corpus: Path, root: Path, lighthouse: str, replica_id: int, steps: int, **fields: object) -> list[str]:
    return job_args(corpus, root / f"group{replica_id}", train__steps=steps, ft__enabled=True,
                    ft__lighthouse=lighthouse, ft__replica_id=replica_id, ft__replica_groups=2, ft__min_replicas=1,
                    ft__quorum_timeout_s=30, ft__timeout_s=20, **fields)


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}


def by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records}


def test_two_groups_without_a_fault_train_what_one_process_trains(corpus, tmp_path, env):
    steps = 3
    lighthouse = Lighthouse(env, min_replicas=2)  # the first step waits for both groups
    groups = [ReplicaGroupJob(tmp_path / f"group{g}", group_args(corpus, tmp_path, lighthouse.address, g, steps),
                              GROUP_RANKS, env) for g in (0, 1)]
    try:
        # The reference meanwhile: one process reading the same global batch (4 ranks x ACCUM microbatches).
        assert run.main(job_args(corpus, tmp_path / "one", train__steps=steps, train__grad_accum=4 * ACCUM)) == 0
        assert [group.wait(120) for group in groups] == [0, 0], groups[0].log.read_text()[-3000:]
    finally:
        for job in (*groups, lighthouse):
            job.stop()
    expected = by_step(read_records(tmp_path / "one"))
    got = [by_step(group.records()) for group in groups]
    for step in range(1, steps + 1):
        for g in (0, 1):
            assert got[g][step]["valid_tokens"] == expected[step]["valid_tokens"]
            assert got[g][step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5, abs=1e-6), (g, step)
            assert got[g][step]["ft_participants"] == [0, 1]
        assert got[0][step]["param_checksum"] == got[1][step]["param_checksum"]
        assert got[0][step]["ft_group_tokens"] + got[1][step]["ft_group_tokens"] == expected[step]["valid_tokens"]
    assert expected[steps]["loss"] < expected[1]["loss"]  # it learns: equal losses are not vacuous
    assert (tmp_path / "group0" / "checkpoints").is_dir() and not (tmp_path / "group1" / "checkpoints").exists()
