"""How `bench sync` calibrates and compares against the simulator: overhead fit and paired bootstrap."""

import numpy as np
import pytest

from moetrain.bench.simulate import CommModel, Link, Workload, simulate_step_times
from moetrain.bench.sync_calibration import fit_per_call_overhead
from moetrain.bench.sync_model import items_per_microbatch, packed_shape, work_units
from moetrain.bench.sync_options import SyncBenchOptions
from moetrain.bench.sync_report import bootstrap_ratio_ci


def test_per_call_overhead_is_recovered_from_zero_variance_steps():
    opts = SyncBenchOptions(replicate=2, shard=2, accum=4, layers=3)
    comm = CommModel(intra=Link(2e-4, 1e9), inter=Link(2e-4, 1e9), ranks_per_node=4)
    workload = Workload(layers=3, grad_bytes=3e5, overlap="blocking")
    true_overhead = {"fsdp": 4e-3, "hsdp": 2.5e-3, "hsdp-delayed": 2.5e-3, "hsdp-final-only": 2.5e-3}
    calibration = []
    for mode, overhead in true_overhead.items():
        true = Workload(layers=3, grad_bytes=3e5, overlap="blocking", per_call_overhead_s=overhead)
        compute = np.full((1, 4, 2), 0.03)
        calibration.append((mode, float(simulate_step_times(compute, 2, 2, mode, true, comm)[0]), 0.03))
    fitted = fit_per_call_overhead(opts, calibration, workload, comm)
    assert fitted == pytest.approx({"1d": 4e-3, "2d": 2.5e-3})


def test_paired_bootstrap_keeps_pairs_together():
    rng = np.random.default_rng(0)
    reference = rng.uniform(0.5, 2.0, 40)  # large step-to-step spread ...
    steps = {"hsdp-delayed": reference, "hsdp": 1.2 * reference}  # ... but a constant paired ratio
    ci = bootstrap_ratio_ci(steps, "hsdp-delayed", 500, seed=0)
    point, low, high = ci["hsdp"]
    assert point == pytest.approx(1.2) and low == pytest.approx(1.2) and high == pytest.approx(1.2)
    assert ci["hsdp-delayed"] == (1.0, 1.0, 1.0)
    # Unpaired noise widens the interval around the true ratio.
    noisy = {"hsdp-delayed": reference, "hsdp": 1.2 * reference * rng.uniform(0.9, 1.1, 40)}
    point, low, high = bootstrap_ratio_ci(noisy, "hsdp-delayed", 500, seed=0)["hsdp"]
    assert low < point < high and low < 1.2 < high


def test_packed_microbatches_keep_the_token_count_while_document_length_varies():
    opts = SyncBenchOptions(cost_model="packed", packed_tokens=1024)
    costs = np.array([1.0, 63.6, 64.0, 300.0, 1024.0, 5000.0])
    documents, length = packed_shape(opts, costs)
    assert length.tolist() == [1, 64, 64, 300, 1024, 1024]
    assert documents.tolist() == [1024, 16, 16, 3, 1, 1]
    tokens = items_per_microbatch(opts, costs)
    assert np.all(tokens <= 1024) and np.all(tokens > 1024 - length)  # about the same tokens, whatever the mix
    np.testing.assert_array_equal(work_units(opts, costs), length.astype(float))
    batch = SyncBenchOptions(cost_model="batch")
    np.testing.assert_array_equal(items_per_microbatch(batch, np.array([0.2, 3.6])), [1, 4])
