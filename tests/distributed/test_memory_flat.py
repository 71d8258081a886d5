"""Memory flatness: after warm-up, a 4-rank (gloo) run's resident memory does not grow per step.

Every train record carries every rank's RSS at the end of the step; the least-squares slope
over steps WARMUP+1..STEPS must stay under TOLERANCE on every rank. Why that bound:
- the bug it guards against is a step keeping something of itself alive (its logits, its
  graph, its records). The smallest such thing is the step's logits: 2 microbatches of
  2 x 128 tokens x 259 vocabulary x 4 bytes = 530 KB per step, so such a leak shows as a
  slope >= 530 KB/step (the control below measures it);
- what is not a leak: the heap of a process running gloo settles slowly. The same job shape on
  4 ranks for 200 steps (benchmarks/results/memory_flat_tiny_4ranks.json) grew per rank by
  96-129 KiB/step over steps 1-25, 73-94 over 26-50, 11-49 over 51-75, 9-19 over 76-100 and
  1-5 KiB/step after step 100: decreasing, then flat.
Hence a 50-step warm-up, and 128 KB/step over steps 51-75 sits 4x below the leak and 2.6x
above the drift measured there. The control runs the same job in one process with the bug
planted (every microbatch's logits kept) and must exceed the bound.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetrain.config.job import parse_job_args
from moetrain.observe.peak_memory import growth_per_step
from moetrain.runtime.allocator import rank_environment
from moetrain.testing import run_on_ranks
from moetrain.train import trainer as trainer_module
from moetrain.train.run import run
from stdlib_corpus import copy_stdlib_modules

WARMUP, STEPS = 50, 75
TOLERANCE = 128 * 1024  # bytes per step, see the module docstring
MODULES = ["bisect.py", "colorsys.py", "keyword.py", "this.py", "stat.py", "glob.py", "fnmatch.py", "struct.py"]


def job_argv(corpus: Path, run_dir: Path) -> list[str]:
    fields = {
        "model.dim": 32, "model.n_layers": 2, "model.n_heads": 2, "model.ffn_hidden": 64, "model.max_seq_len": 128,
        "model.moe.n_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 16,
        "data.source": "dir", "data.path": str(corpus), "data.glob": "*.py", "data.seq_len": 128,
        "train.steps": STEPS, "train.microbatch_size": 2, "train.grad_accum": 2, "train.warmup_steps": 2,
        "train.eval_every": 0, "train.sample_tokens": 0, "checkpoint.enabled": False,
        "logging.run_dir": str(run_dir), "logging.log_every": 1, "logging.progress_bar": False,
    }
    argv = ["--config", str(Path(__file__).resolve().parents[2] / "configs" / "tiny_moe.toml")]
    for key, value in fields.items():
        argv += [f"--{key}", str(value)]
    return argv


def train(argv: list[str]) -> None:
    run(parse_job_args(argv))


def rss_slopes(run_dir: Path) -> list[float]:
    """Per rank: bytes per step of the end-of-step RSS over the steps after warm-up."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = sorted((r["step"], r["rss_bytes_per_rank"]) for r in records if r["kind"] == "train" and r["step"] > WARMUP)
    assert len(train) == STEPS - WARMUP
    steps = [step for step, _ in train]
    return [growth_per_step(steps, [per_rank[rank] for _, per_rank in train]) for rank in range(len(train[0][1]))]


@pytest.fixture
def corpus(tmp_path) -> Path:
    return copy_stdlib_modules(tmp_path / "corpus", MODULES)


def test_four_rank_run_is_memory_flat_after_warmup(corpus, tmp_path):
    run_dir = tmp_path / "run"
    # With the allocator settings every rank of a torchrun job gets.
    run_on_ranks(train, 4, job_argv(corpus, run_dir), timeout=240, rank_env=rank_environment(4))
    slopes = rss_slopes(run_dir)
    assert len(slopes) == 4
    print("RSS slope after warm-up per rank, KiB/step:", [round(slope / 1024, 1) for slope in slopes])
    assert max(slopes) < TOLERANCE, f"RSS grows per step after warm-up: {[round(s / 1024) for s in slopes]} KiB"


def leaky_train(argv: list[str]) -> int:
    """`train` with the planted bug: every microbatch's logits stay alive. Returns how many were kept."""
    kept = []
    token_loss_sum = trainer_module.token_loss_sum

    def leaky_token_loss_sum(logits, targets):
        kept.append(logits.detach())
        return token_loss_sum(logits, targets)

    trainer_module.token_loss_sum = leaky_token_loss_sum
    train(argv)
    return len(kept)


def test_the_flatness_bound_catches_a_step_that_keeps_its_logits(corpus, tmp_path):
    # One fresh process, as a one-process job starts, with no GEMM peak cached, so MFU's peak is probed at
    # the first step. A probe run in-process left 48 MiB of freed operands in the heap, which the leak then
    # filled without the RSS growing (2 KiB/step measured).
    run_dir = tmp_path / "leaky"
    cache = {"MOETRAIN_CACHE_DIR": str(tmp_path / "empty-cache")}
    [kept] = run_on_ranks(leaky_train, 1, job_argv(corpus, run_dir), timeout=240, rank_env=cache)
    assert kept >= 2 * STEPS  # and the final evaluation's forwards
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["peak_flops_source"] for r in records if r["kind"] == "train"][0] in ("measured idle", "busy estimate")
    slope = rss_slopes(run_dir)[0]
    print(f"RSS slope with the planted leak: {slope / 1024:.0f} KiB/step")
    assert slope > TOLERANCE, f"{slope / 1024:.0f} KiB/step"
