"""Multi-token prediction under tensor and context parallelism (and a pipeline over either) against one float64 process.

On 4 gloo ranks the Trainer's own step runs FSDP 2 x TP 2, FSDP 2 x CP 2, PP 2 x TP 2 and PP 2 x CP 2 with
MTP modules (depth 2 on grouped-query attention, depth 1 on MLA), fed packed rows of documents of 3-7 tokens
that cross every CP chunk boundary, some targets masked, three microbatches per step, one without any valid
target (split_trainer_support). Under CP a rank's last position of a chunk looks ahead into another rank's
chunk: its tokens ahead and MTP targets come from the whole rows, and a target never comes from another
document. The reference is one float64 process over the same global batch (no parallel code): main loss +
λ/D Σ_k CE_k with each depth's targets counted over the whole step, the same SGD steps. Every step's loss and
logged MTP loss, the step-0 gradients (the MTP modules' included) and the final parameters must agree within
1e-5 relative (of the largest entry, per tensor).
"""

from __future__ import annotations

import pytest
import torch
from split_parity_support import SEQ, initial_state, relative_error
from split_trainer_support import data_ranks, job_config, make_batches, model_config, reference_run, run_layouts

from moetrain.data.packing import IGNORE_INDEX
from moetrain.parallel.context_parallel import head_tail_indices
from moetrain.train.loss import mtp_targets

BOUND = 1e-5

# name -> (model, MTP depth, parallel fields)
LAYOUTS = {
    "fsdp2_tp2": ("tiny_moe", 2, {"tp": 2}),
    "fsdp2_cp2_mla": ("deepseek_like", 2, {"cp": 2}),
    "pp2_tp2_mla": ("deepseek_like", 1, {"pp": 2, "tp": 2}),
    "pp2_cp2": ("tiny_moe", 1, {"pp": 2, "cp": 2}),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[dict, dict]]:
    """layout -> (the ranks' merged result, the float64 reference); the 4 ranks forked once for every layout."""
    jobs, references = [], {}
    for index, (name, (model, depth, parallel)) in enumerate(LAYOUTS.items()):
        cfg = model_config(model, mtp_depth=depth)
        state, batches = initial_state(cfg, seed=index), make_batches(cfg, data_ranks(parallel), seed=index)
        references[name] = reference_run(cfg, state, batches)
        jobs.append((job_config(cfg, parallel), state, batches))
    return dict(zip(LAYOUTS, zip(run_layouts(jobs), references.values(), strict=True), strict=True))


@pytest.mark.parametrize("name", LAYOUTS)
def test_mtp_under_tensor_and_context_parallelism_equals_one_float64_process(runs, name):
    result, reference = runs[name]
    assert any(n.startswith("mtp.") for n in result["grads"])
    assert result["grads"].keys() == reference["grads"].keys()  # every parameter has its gradient, once
    for what in ("losses", "mtp_losses"):
        error = max(abs(a - b) / abs(b) for a, b in zip(result[what], reference[what], strict=True))
        assert error < BOUND, (what, error)
    for what in ("grads", "params"):
        error, worst = relative_error(result[what], reference[what])
        assert error < BOUND, (what, worst, error)


def test_mtp_targets_cross_the_cp_split_inside_a_document_and_never_across_one():
    """The rows the CP cases train on: some depth-1 target sits on a CP rank's chunk end and comes from the next
    chunk (another rank's), inside one document, and some such pair spans two documents and is dropped."""
    cfg = model_config("tiny_moe", mtp_depth=2)
    batches = [mb for index in (1, 3) for step in make_batches(cfg, 2, seed=index) for rank in step for mb in rank]
    ends = torch.tensor([int(head_tail_indices(SEQ, 2, rank)[SEQ // 4 - 1]) for rank in range(2)])
    kept = dropped = 0
    for mb in batches:
        targets = mtp_targets(mb.targets, mb.document_ids, 1)
        same = mb.document_ids[:, ends] == mb.document_ids[:, ends + 1]
        kept += int(((targets[:, ends] != IGNORE_INDEX) & same).sum())
        dropped += int((~same & (mb.targets[:, ends + 1] != IGNORE_INDEX)).sum())
        assert (targets[:, ends][~same] == IGNORE_INDEX).all()
    assert kept > 0 and dropped > 0, (kept, dropped)
