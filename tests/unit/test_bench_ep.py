"""`bench ep`'s pure parts: the alpha-beta fit, the per-step reduction, option checks and the prediction."""

import numpy as np
import pytest

from moetrain.bench.ep import EpBenchOptions, _medians, fit_link, predict_steps, validate_options
from moetrain.bench.simulate import CommModel, Experts, Link, Workload, simulate_step_times
from moetrain.errors import ConfigError


def test_fit_link_recovers_alpha_and_bandwidth_from_mixed_collectives():
    alpha, bandwidth = 3e-4, 5e8
    points = []
    for op, factor in (("all_reduce", 2.0), ("all_gather", 1.0), ("all_to_all", 1.0)):
        for ranks in (2, 4):
            for nbytes in (1e3, 1e5, 1e7):
                seconds = factor * ((ranks - 1) * alpha + (ranks - 1) / ranks * nbytes / bandwidth)
                points.append({"op": op, "ranks": ranks, "bytes": nbytes, "seconds": seconds})
    link = fit_link(points)
    assert link.alpha_s == pytest.approx(alpha, rel=1e-6) and link.bandwidth == pytest.approx(bandwidth, rel=1e-6)


def test_medians_take_the_slowest_rank_for_the_step_and_rank_means_otherwise():
    # 3 steps x 2 ranks x 10 fields
    rows = np.zeros((3, 2, 10))
    rows[:, :, 0] = [[1.0, 1.2], [2.0, 1.5], [1.1, 0.9]]
    rows[:, :, 1] = [[0.4, 0.6], [1.0, 1.0], [0.2, 0.4]]
    medians = _medians(rows.tolist())
    assert medians["step_s"] == pytest.approx(1.2)  # median of 1.2, 2.0, 1.1
    assert medians["compute_s"] == pytest.approx(0.5)  # median of 0.5, 1.0, 0.3


@pytest.mark.parametrize("overrides,match", [
    ({"eps": (2, 4)}, "eps"), ({"eps": (1, 1)}, "eps"), ({"eps": (1, 3)}, "parallel.ep = 3"),
    ({"world": 2, "eps": (1, 4)}, "parallel.ep = 4"), ({"steps": 0}, "steps"),
])
def test_bad_options_are_one_line_errors(overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        validate_options(EpBenchOptions(**overrides))
    assert "\n" not in str(err.value)


def test_prediction_fits_the_host_factor_on_fsdp_only_and_predicts_ep():
    opts = EpBenchOptions(world=4, eps=(1, 2), grad_accum=1)
    layout = {"layers": 4, "moe_layers": 3, "param_bytes": 2.5e7, "expert_param_bytes": 1.9e7,
              "dispatch_bytes_per_moe_layer": 1e6}
    ring, a2a = Link(4e-4, 5e8), Link(5e-4, 7e8)
    experts = Experts(moe_units=3, param_bytes=1.9e7, dispatch_bytes=1e6)
    workload = Workload(layers=6, grad_bytes=2.5e7, overlap="blocking")

    def truth(ep, compute, factor):  # a host that slows every collective by `factor`
        scaled = CommModel(intra=Link(4e-4 * factor, 5e8 / factor), inter=Link(4e-4 * factor, 5e8 / factor),
                           ranks_per_node=4, all_to_all_link=Link(5e-4 * factor, 7e8 / factor))
        return float(simulate_step_times(np.full((1, 1, 1), compute), 1, 4, "fsdp", workload, scaled, experts,
                                         ep)[0])

    measured = {}
    for ep, compute in ((1, 0.5), (2, 0.4)):
        step = truth(ep, compute, 3.0)
        measured[ep] = {"step_s": step, "compute_s": compute, "fsdp_collectives_s": step - compute,
                        "all_to_all_s": 0.0}
    measured[2]["fsdp_collectives_s"] = 0.0  # only the FSDP-only mode's decomposition is used for the fit
    prediction = predict_steps(opts, measured, layout, ring, a2a)
    assert prediction["host_factor"] == pytest.approx(3.0)
    assert prediction["modes"][2]["predicted_step_s"] == pytest.approx(measured[2]["step_s"])
    assert prediction["modes"][2]["idle_host_step_s"] < measured[2]["step_s"]
