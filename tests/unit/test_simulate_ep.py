"""The simulator's expert-parallel terms against hand-derived alpha-beta sums, and its command line."""

import json
import math

import numpy as np
import pytest

from moetrain.bench.simulate import CommModel, Experts, Link, Workload, collective_times, main, simulate_step_times
from moetrain.errors import ConfigError

# Slow, distinct links so every term is visible: 4 ranks per node.
COMM = CommModel(intra=Link(1e-3, 1e8), inter=Link(4e-3, 1e7), ranks_per_node=4, algorithm="ring")


def test_all_to_all_is_a_pairwise_exchange():
    link = Link(2.0, 10.0)
    assert COMM.all_to_all(100.0, 4, link) == pytest.approx(3 * 2.0 + 0.75 * 100 / 10)
    assert COMM.all_to_all(100.0, 1, link) == 0.0
    tree = CommModel(algorithm="tree")
    assert tree.all_to_all(100.0, 4, link) == COMM.all_to_all(100.0, 4, link)


def test_no_experts_leaves_every_time_unchanged():
    costs = np.full((2, 3, 2), 0.05)
    workload = Workload(layers=3, grad_bytes=3e6, overlap="blocking")
    for mode in ("fsdp", "hsdp", "hsdp-delayed"):
        plain = simulate_step_times(costs, 2, 4, mode, workload, COMM)
        with_dense_experts = simulate_step_times(costs, 2, 4, mode, workload, COMM, Experts(), 1)
        np.testing.assert_array_equal(plain, with_dense_experts)


def test_hsdp_blocking_step_is_the_hand_derived_sum_with_and_without_ep():
    accum, cost, replicate, shard, ep = 3, 0.05, 2, 4, 2
    layers, moe_units = 3, 2
    param, expert, dispatch = 6e5, 4e5, 2e5
    workload = Workload(layers=layers, grad_bytes=param, overlap="blocking", reshard_after_forward=True)
    experts = Experts(moe_units=moe_units, param_bytes=expert, dispatch_bytes=dispatch)
    costs = np.full((1, accum, replicate), cost)
    dense, per_moe = (param - expert) / layers, expert / moe_units
    intra, inter = COMM.intra, COMM.inter

    def ring(nbytes, n, link):  # reduce-scatter / all-gather
        return (n - 1) * link.alpha_s + (n - 1) / n * nbytes / link.bandwidth

    def all_reduce(nbytes, n, link):
        return 2 * ring(nbytes, n, link)

    # FSDP-only: a MoE unit gathers and reduces its dense share and all its experts in one call each.
    ct1 = collective_times("hsdp", replicate, shard, workload, COMM, experts, 1)
    assert ct1.all_gather == pytest.approx(ring(dense, shard, intra))
    assert ct1.moe_all_gather == pytest.approx(ring(dense + per_moe, shard, intra))
    assert ct1.moe_all_reduce == pytest.approx(all_reduce((dense + per_moe) / shard, replicate, inter))
    assert ct1.all_to_all_forward == 0.0
    # EP = 2: experts on the 2 ranks holding the same half (stride 2 inside the node), tokens among 2 ranks.
    ct2 = collective_times("hsdp", replicate, shard, workload, COMM, experts, ep)
    expert_gather = ring(per_moe / ep, shard // ep, intra)
    assert ct2.moe_all_gather == pytest.approx(ring(dense, shard, intra) + expert_gather)
    assert ct2.moe_reduce_scatter == pytest.approx(ring(dense, shard, intra) + expert_gather)
    assert ct2.moe_all_reduce == pytest.approx(all_reduce(dense / shard, replicate, inter)
                                               + all_reduce(per_moe / ep / (shard // ep), replicate, inter))
    rows, latency = COMM.all_to_all(dispatch, ep, intra), COMM.all_to_all(0.0, ep, intra)
    assert ct2.all_to_all_forward == pytest.approx(2 * rows + 2 * latency)
    assert ct2.all_to_all_backward == pytest.approx(2 * rows + latency)
    # Blocking step: per microbatch, compute + 2 gathers per unit + a reduce-scatter and all-reduce per unit
    # + the token exchanges of each MoE unit, forward and backward.
    for ep_, ct in ((1, ct1), (ep, ct2)):
        per_microbatch = (cost + 2 * (layers - moe_units) * ct.all_gather + 2 * moe_units * ct.moe_all_gather
                          + (layers - moe_units) * (ct.reduce_scatter + ct.all_reduce)
                          + moe_units * (ct.moe_reduce_scatter + ct.moe_all_reduce)
                          + moe_units * (ct.all_to_all_forward + ct.all_to_all_backward))
        step = simulate_step_times(costs, replicate, shard, "hsdp", workload, COMM, experts, ep_)[0]
        assert step == pytest.approx(accum * per_microbatch)


def test_ep_trades_expert_gathers_across_nodes_for_token_exchanges_inside_one():
    # 1-D FSDP over 4 nodes of 4: FSDP-only gathers every expert over the slow link; EP = 4 keeps the token
    # exchange inside a node and gathers a quarter of the experts. With negligible tokens EP must win, with
    # huge dispatches it must lose: the model has to see both sides.
    workload = Workload(layers=4, grad_bytes=4e8, overlap="blocking")
    costs = np.full((1, 2, 1), 0.1)
    step = {}
    for dispatch in (1e3, 1e10):
        experts = Experts(moe_units=4, param_bytes=3e8, dispatch_bytes=dispatch)
        for ep in (1, 4):
            step[(dispatch, ep)] = simulate_step_times(costs, 1, 16, "fsdp", workload, COMM, experts, ep)[0]
    assert step[(1e3, 4)] < 0.5 * step[(1e3, 1)]
    assert step[(1e10, 4)] > step[(1e10, 1)]


@pytest.mark.parametrize("experts,ep,match", [
    (Experts(moe_units=5), 1, "moe_units"),
    (Experts(moe_units=1, param_bytes=1e12), 1, "param_bytes"),
    (Experts(param_bytes=1.0), 1, "moe_units = 0"),
    (Experts(moe_units=1), 3, "ep = 3"),
    (Experts(), 2, "without MoE units"),
])
def test_bad_expert_settings_raise_config_errors(experts, ep, match):
    with pytest.raises(ConfigError, match=match):
        simulate_step_times(np.ones((1, 2, 1)), 1, 4, "fsdp", Workload(layers=4), CommModel(), experts, ep)


def test_command_line_compares_ep_degrees(tmp_path, capsys):
    out = tmp_path / "ep.json"
    args = ["--replicate", "2", "--shard", "8", "--accum", "2", "--samples", "20", "--modes", "fsdp", "hsdp-delayed",
            "--ep", "1", "8", "--workload.layers", "4", "--experts.moe-units", "4", "--experts.param-bytes", "1e9",
            "--experts.dispatch-bytes", "1e6", "--json", str(out)]
    assert main(args) == 0
    modes = json.loads(out.read_text())["modes"]
    assert [(m["mode"], m["ep"]) for m in modes] == [("fsdp", 1), ("hsdp-delayed", 1), ("fsdp", 8),
                                                     ("hsdp-delayed", 8)]
    assert all(m["ratio_to_ep1"] == 1.0 for m in modes if m["ep"] == 1)
    assert all(math.isfinite(m["ratio_to_ep1"]) and m["ratio_to_ep1"] < 1 for m in modes if m["ep"] == 8)
    assert "/ ep=1" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="ep = 3"):
        main(["--shard", "8", "--ep", "3", "--experts.moe-units", "2"])
    with pytest.raises(ConfigError, match="needs MoE units"):
        main(["--shard", "8", "--ep", "2"])
