"""The step-time simulator against closed forms in its limiting cases, and its command line."""

import json
import math

import numpy as np
import pytest

from moetrain.bench.costs import CostSpec, draw_costs, expected_max_of_sum_bimodal, expected_sum_of_max_bimodal
from moetrain.bench.simulate import MODES, CommModel, Link, Workload, collective_times, main, simulate_step_times
from moetrain.errors import ConfigError

FREE = CommModel(intra=Link(0.0, math.inf), inter=Link(0.0, math.inf))
BIMODAL = CostSpec("bimodal", short=0.04, ratio=4.0, p_long=0.5)


@pytest.mark.parametrize("accum, groups", [(4, 2), (8, 2), (5, 4)])
def test_zero_comm_single_unit_is_sum_of_max_versus_max_of_sum(accum, groups):
    costs = draw_costs(BIMODAL, seed=0, steps=4000, accum=accum, groups=groups)
    workload = Workload(layers=1, grad_bytes=1e6, overlap="blocking")
    step = {mode: simulate_step_times(costs, groups, 2, mode, workload, FREE) for mode in MODES}
    sum_of_max = costs.max(axis=2).sum(axis=1)  # every microbatch waits for the slowest group
    max_of_sum = costs.sum(axis=1).max(axis=1)  # groups only meet at the end of the step
    np.testing.assert_allclose(step["hsdp"], sum_of_max)
    np.testing.assert_allclose(step["fsdp"], sum_of_max)
    np.testing.assert_allclose(step["hsdp-delayed"], max_of_sum)
    np.testing.assert_allclose(step["hsdp-final-only"], max_of_sum)
    # ... and the Monte Carlo means approach the exact bimodal expectations.
    assert step["hsdp"].mean() == pytest.approx(expected_sum_of_max_bimodal(BIMODAL, accum, groups), rel=0.02)
    assert step["hsdp-delayed"].mean() == pytest.approx(expected_max_of_sum_bimodal(BIMODAL, accum, groups),
                                                        rel=0.02)


@pytest.mark.parametrize("overlap", ["blocking", "backward", "next_microbatch"])
def test_zero_comm_many_units_hsdp_still_waits_every_microbatch(overlap):
    costs = draw_costs(CostSpec("lognormal", 1.0, cv=0.8), seed=1, steps=300, accum=6, groups=3)
    workload = Workload(layers=6, overlap=overlap)
    hsdp = simulate_step_times(costs, 3, 4, "hsdp", workload, FREE)
    delayed = simulate_step_times(costs, 3, 4, "hsdp-delayed", workload, FREE)
    max_of_sum = costs.sum(axis=1).max(axis=1)
    if overlap == "next_microbatch":  # nothing couples groups before the final wait
        np.testing.assert_allclose(hsdp, max_of_sum)
    else:
        np.testing.assert_allclose(hsdp, costs.max(axis=2).sum(axis=1))
    # With several units the delayed step syncs on each unit of the final backward: at least max of sums.
    assert np.all(delayed >= max_of_sum - 1e-12)
    assert np.all(delayed <= hsdp + 1e-12)


def _comm():
    return CommModel(intra=Link(1e-3, 1e8), inter=Link(3e-3, 1e7), ranks_per_node=2, algorithm="ring")


def test_zero_variance_blocking_matches_closed_form_and_delayed_saves_the_all_reduces():
    accum, layers, cost, groups, shard = 8, 4, 0.05, 2, 2
    costs = np.full((3, accum, groups), cost)
    workload = Workload(layers=layers, grad_bytes=4e5, overlap="blocking", reshard_after_forward=True)
    comm = _comm()
    t = {mode: simulate_step_times(costs, groups, shard, mode, workload, comm)[0] for mode in MODES}
    ct = {mode: collective_times(mode, groups, shard, workload, comm) for mode in MODES}
    unit = 4e5 / layers
    # Hand-derived alpha-beta values: shard pair inside a node, replicate pair across nodes.
    assert ct["hsdp"].reduce_scatter == pytest.approx(1e-3 + 0.5 * unit / 1e8)
    assert ct["hsdp"].all_reduce == pytest.approx(2 * (3e-3 + 0.5 * (unit / 2) / 1e7))
    assert ct["fsdp"].reduce_scatter == pytest.approx(3 * 3e-3 + 0.75 * unit / 1e7)
    gathers = 2 * layers  # forward + again before backward
    for mode in ("hsdp", "hsdp-delayed"):
        c = ct[mode]
        all_reduces = accum if mode == "hsdp" else 1
        expected = accum * (cost + gathers * c.all_gather + layers * c.reduce_scatter) + all_reduces * layers * \
            ct["hsdp"].all_reduce
        assert t[mode] == pytest.approx(expected)
    c = ct["hsdp-final-only"]
    assert t["hsdp-final-only"] == pytest.approx(accum * (cost + gathers * c.all_gather)
                                                 + layers * (c.reduce_scatter + ct["hsdp"].all_reduce))
    c = ct["fsdp"]
    assert t["fsdp"] == pytest.approx(accum * (cost + gathers * c.all_gather + layers * c.reduce_scatter))
    # Zero variance: the only gain of delaying is the skipped all-reduces.
    assert t["hsdp"] - t["hsdp-delayed"] == pytest.approx((accum - 1) * layers * ct["hsdp"].all_reduce)


def test_zero_variance_backward_overlap_exposes_only_the_last_units_collectives():
    accum, layers, cost = 4, 8, 1.0
    costs = np.full((2, accum, 2), cost)
    comm = CommModel(intra=Link(1e-3, 1e9), inter=Link(1e-3, 1e9), ranks_per_node=2)
    workload = Workload(layers=layers, grad_bytes=8e6, overlap="backward")  # every collective << a unit's compute
    ct = collective_times("hsdp", 2, 2, workload, comm)
    hsdp = simulate_step_times(costs, 2, 2, "hsdp", workload, comm)[0]
    delayed = simulate_step_times(costs, 2, 2, "hsdp-delayed", workload, comm)[0]
    # Per microbatch: the first unit's all-gather (nothing to hide it behind), the compute, and the
    # last unit's reduce-scatter (+ all-reduce) after the backward ends.
    assert hsdp == pytest.approx(accum * (ct.all_gather + cost + ct.reduce_scatter + ct.all_reduce))
    assert delayed == pytest.approx(accum * (ct.all_gather + cost + ct.reduce_scatter) + ct.all_reduce)


def test_tree_and_node_placement():
    comm = CommModel(intra=Link(1.0, 10.0), inter=Link(2.0, 5.0), ranks_per_node=4, algorithm="tree")
    assert comm.link([0, 1, 2, 3]) is comm.intra
    assert comm.link([0, 4]) is comm.inter
    assert comm.all_reduce(100.0, 8, comm.inter) == pytest.approx(2 * 3 * 2.0 + 2 * 100 / 5)
    assert comm.reduce_scatter(80.0, 4, comm.intra) == pytest.approx(2 * 1.0 + 0.75 * 80 / 10)
    assert comm.all_reduce(100.0, 1, comm.inter) == 0.0


def test_delaying_never_slows_a_step_down():
    costs = draw_costs(CostSpec("lognormal", 0.1, cv=1.0), seed=2, steps=200, accum=4, groups=4)
    for overlap in ("blocking", "backward", "next_microbatch"):
        workload = Workload(layers=3, grad_bytes=1e8, overlap=overlap)
        hsdp = simulate_step_times(costs, 4, 8, "hsdp", workload, CommModel())
        delayed = simulate_step_times(costs, 4, 8, "hsdp-delayed", workload, CommModel())
        assert np.all(delayed <= hsdp + 1e-12)


def test_bad_inputs_raise_config_errors():
    costs = np.ones((2, 3, 2))
    with pytest.raises(ConfigError, match="mode"):
        simulate_step_times(costs, 2, 2, "ddp", Workload(), CommModel())
    with pytest.raises(ConfigError, match="shape"):
        simulate_step_times(costs, 3, 2, "hsdp", Workload(), CommModel())
    with pytest.raises(ConfigError, match="alpha_s"):
        simulate_step_times(costs, 2, 2, "hsdp", Workload(), CommModel(intra=Link(-1.0, 1.0)))
    with pytest.raises(ConfigError, match="overlap"):
        simulate_step_times(costs, 2, 2, "hsdp", Workload(overlap="sometimes"), CommModel())


def test_command_line_writes_json_and_rejects_bad_values(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["--replicate", "4", "--shard", "2", "--accum", "4", "--samples", "50", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [m["mode"] for m in data["modes"]] == list(MODES)
    ratios = {m["mode"]: m["ratio_to_reference"] for m in data["modes"]}
    assert ratios["hsdp-delayed"] == 1.0 and ratios["hsdp"] > 1.0
    assert "hsdp-delayed" in capsys.readouterr().out
    # The figure sweeps replica groups and cost CV; at CV 0 and one group delaying gains (almost) nothing.
    png = tmp_path / "sim.png"
    assert main(["--replicate", "4", "--shard", "2", "--accum", "4", "--samples", "50", "--figure", str(png),
                 "--group-counts", "1", "4", "--cvs", "0", "1", "--json", str(out)]) == 0
    sweep = json.loads(out.read_text())["figure"]
    assert png.stat().st_size > 0
    for key in ("speedup_by_groups", "speedup_by_cv"):
        assert sweep[key][0] == pytest.approx(1.0, abs=0.01)
        assert sweep[key][1] > 1.05
    # A measured trace replaces the drawn costs.
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"costs_s": np.full((3, 4, 4), 0.1).tolist()}))
    assert main(["--replicate", "4", "--shard", "2", "--accum", "4", "--trace", str(trace)]) == 0
    for argv, match in [(["--accum", "0"], "accum"), (["--cost.ratio", "0.5"], "ratio"),
                        (["--modes", "ddp"], "modes"), (["--replicate", "x"], "replicate"),
                        (["--trace", str(tmp_path / "missing.json")], "trace")]:
        with pytest.raises(ConfigError, match=match):
            main(argv)
