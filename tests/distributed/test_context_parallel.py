"""Context parallelism on 4 gloo ranks against one float64 process; the head-tail split.

One 4-rank run (module fixture) trains every case of `CASES` for 2 SGD steps of 2 packed microbatches per
data-parallel rank, the way the trainer does (`SequenceSplit`: each rank its head and tail chunks of every
row, keys and values gathered over the CP group, attention tile by tile under the whole rows' document
mask): CP 2 x FSDP 2, CP 2 x TP 2 and CP 2 x EP 2 on a tiny MoE, and CP 2 x FSDP 2 on a GPT-OSS-shaped
(sinks, a sliding window, biases), a GLM-4.5-shaped (partial RoPE, per-head QK-norm) and a DeepSeek-V3-shaped
(MLA) model. Documents of 3-7 tokens in rows of 16 cut into 4 or 8 chunks cross every chunk boundary
(checked). Losses of every step, step-0 gradients and the final parameters are checked within 1e-5 of the
largest reference entry.
"""

from __future__ import annotations

import pytest
import torch
from split_parity_support import SEQ, TINY_MOE, check_case, make_batches, run_cases

from moetrain.parallel.context_parallel import head_tail_indices

CASES = {
    "tiny_moe-cp2-fsdp2": ("tiny_moe", {"cp": 2}),
    "tiny_moe-cp2-tp2": ("tiny_moe", {"cp": 2, "tp": 2}),
    # Each CP rank routes its own chunks of every row through its 2-rank EP group; experts FSDP over efsdp x cp.
    "tiny_moe-cp2-ep2": ("tiny_moe", {"cp": 2, "ep": 2}),
    "gpt_oss_like-cp2-fsdp2": ("gpt_oss_like", {"cp": 2}),
    "glm_like-cp2-fsdp2": ("glm_like", {"cp": 2}),
    "deepseek_like-cp2-fsdp2": ("deepseek_like", {"cp": 2}),
}


@pytest.fixture(scope="module")
def results():
    return run_cases(CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_trains_like_one_process(results, case):
    check_case(*results[case])


def test_documents_cross_every_chunk_boundary_of_the_split():
    for cp in (2, 4):  # cp 2 x tp 2 cuts the CP slices once more: the boundaries of 2 x 4 chunks
        boundaries = range(SEQ // (2 * cp), SEQ, SEQ // (2 * cp))
        rows = [mb.document_ids[row] for step in make_batches(TINY_MOE, 2) for rank in step for mb in rank
                for row in range(mb.document_ids.shape[0])]
        for boundary in boundaries:
            assert any(bool(ids[boundary - 1] == ids[boundary]) for ids in rows), (cp, boundary)


@pytest.mark.parametrize("seq,cp", [(16, 2), (64, 4), (24, 3)])
def test_head_tail_split_covers_each_token_once_with_equal_causal_work(seq, cp):
    shares = [head_tail_indices(seq, cp, rank) for rank in range(cp)]
    assert torch.equal(torch.sort(torch.cat(shares)).values, torch.arange(seq))
    # Under a causal mask query i attends to i + 1 keys: every rank gets the same number of scores.
    work = {int((share + 1).sum()) for share in shares}
    assert work == {seq * (seq + 1) // (2 * cp)}


def test_head_tail_split_refuses_a_sequence_it_cannot_cut_evenly():
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 4"):
        head_tail_indices(10, 2, 0)
