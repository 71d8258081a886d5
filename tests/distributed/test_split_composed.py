"""Context parallelism under HSDP on 8 gloo ranks, against one float64 process.

One 8-rank run (module fixture) trains HSDP 2 x 2 (dp_replicate 2, dp_shard 2) with CP 2 for 2 SGD steps of 2
packed microbatches per data-parallel rank through `SequenceSplit`, as tests/distributed/test_context_parallel.py
does on 4 ranks: the CP ranks fold into the shard dimension inside each replica ("dp_shard_cp"), so gradients
are reduce-scattered over shard x cp ranks and all-reduced over the replicas. Losses of every step, step-0
gradients and the final parameters within 1e-5 of the largest reference entry. (EP 2 x CP 2 runs in
test_context_parallel.py's 4-rank fixture.)
"""

from __future__ import annotations

import pytest
from split_parity_support import check_case, run_cases

CASES = {"tiny_moe-hsdp2x2-cp2": ("tiny_moe", {"dp_replicate": 2, "cp": 2})}


@pytest.fixture(scope="module")
def results():
    return run_cases(CASES, world=8)


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_under_hsdp_trains_like_one_process(results, case):
    check_case(*results[case])
