"""`moetrain export-hf` of a tensor-parallel run on one process equals the export on the run's own ranks.

A checkpoint keeps the whole model's names (DCP), so any world can read it; when the run's mesh does not
fit the exporting world the export falls back to plain FSDP over it, and that fallback must drop the
tensor, context and pipeline degrees too (it once kept tp = 2 and refused a one-process export).
"""

from __future__ import annotations

import os
import subprocess

import pytest
from safetensors.torch import load_file
from test_train_torchrun import TORCHRUN, _torchrun

from moetrain.commands.export_hf import ExportOptions, export

WEIGHTS = "model-00001-of-00001.safetensors"


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH next to this interpreter")
def test_one_process_export_of_a_tp2_run_equals_its_4_rank_export(job_args, tmp_path):
    run_dir = tmp_path / "tp2"
    done = _torchrun(4, job_args(run_dir, parallel__tp=2, model__moe__aux_loss_scope="global_batch",
                                 train__steps=2, train__eval_every=0, checkpoint__every=2))
    assert done.returncode == 0, done.stderr[-3000:]
    on_ranks = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "4", "-m", "moetrain", "export-hf",
                               "--run-dir", str(run_dir), "--out", str(tmp_path / "hf4")],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=150)
    assert on_ranks.returncode == 0, on_ranks.stderr[-3000:]
    export(ExportOptions(run_dir=str(run_dir), out=str(tmp_path / "hf1")))
    one, four = load_file(tmp_path / "hf1" / WEIGHTS), load_file(tmp_path / "hf4" / WEIGHTS)
    assert one.keys() == four.keys() and len(one) > 10
    assert all(one[name].equal(four[name]) for name in one)
