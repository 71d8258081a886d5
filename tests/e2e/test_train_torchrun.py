"""torchrun on CPU: HSDP 2x2 with the delayed all-reduce trains; its checkpoint reshards to 1 and 2 ranks (DCP)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moetrain.train import run

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")


def _torchrun(nproc: int, args: list[str], extra_env: dict[str, str] | None = None, max_restarts: int = 0,
              timeout_s: float = 150) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    # --standalone: torchrun's own rendezvous on a port it picks, so no port can be raced for.
    command = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
               "-m", "moetrain", "train", *args]
    # Own session, so a hang kills torchrun and every rank it started, not just torchrun.
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout_s:g} s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH next to this interpreter")
def test_hsdp_2x2_delayed_all_reduce_then_resume_on_2_ranks(job_args, read_train_records, tmp_path):
    run_dir = tmp_path / "hsdp"
    hsdp = ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", "--parallel.sync_policy", "delayed_all_reduce"]
    done = _torchrun(4, job_args(run_dir, train__steps=4, checkpoint__every=2, train__eval_every=2,
                                 train__stop_at_step=2) + hsdp)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = records[0]
    assert (start["event"], start["world_size"], start["sync_policy"]) == ("start", 4, "delayed_all_reduce")
    train = read_train_records(run_dir)
    assert sorted(train) == [1, 2]
    assert len(train[2]["wait_s_per_rank"]) == 4 and len(train[2]["tokens_per_s_per_rank"]) == 4
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in train.values())
    assert (run_dir / "checkpoints" / "step_00000002" / "meta.json").is_file()

    # Resharded weights compute the same function: one process loading the 4-rank checkpoint
    # (resume with nothing left to train, so only the final evaluation runs) gets the held-out
    # loss the 4 ranks measured at step 2 on the same evaluation set.
    eval_4_ranks = [r for r in records if r["kind"] == "eval" and r["step"] == 2]
    assert run.main(job_args(run_dir, train__steps=2, checkpoint__resume=True)) == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final_1_rank = lines[-1]
    assert final_1_rank["kind"] == "final" and final_1_rank["step"] == 2
    assert final_1_rank["heldout_tokens"] == eval_4_ranks[0]["heldout_tokens"]
    assert final_1_rank["heldout_loss"] == pytest.approx(eval_4_ranks[0]["heldout_loss"], rel=1e-5)

    # The 4-rank (2x2) checkpoint loads into a 2-rank FSDP mesh: DCP reshards model and optimizer.
    resumed = _torchrun(2, job_args(run_dir, train__steps=4, checkpoint__every=2, train__eval_every=2,
                                    checkpoint__resume=True))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint was written by 4 ranks, resuming on 2" in resumed.stderr
    final = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["kind"] == "final" and final["step"] == 4 and final["heldout_bpb"] > 0
