"""The failure/goodput model of `moetrain simulate goodput` against its long-run closed forms.

A small cluster that fails often, over a long horizon: the simulated histories' mean goodput must
converge to the renewal-reward closed forms (checkpoint-restart and torchft), which are derived
independently of the event code (moetrain.bench.goodput's docstring).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from moetrain import cli
from moetrain.bench.goodput import (
    GoodputOptions,
    closed_form_checkpoint_restart,
    closed_form_torchft,
    cluster,
    draw_failures,
    simulate_checkpoint_restart,
    simulate_torchft,
)

# 8 nodes in 4 groups of 2, a node failing every 6 h: 32 failures a day, about 12,800 in 400 days.
OPTS = GoodputOptions(gpus=(64,), gpus_per_node=8, node_mtbf_h=(6.0,), days=400.0, restart_s=600.0,
                      checkpoint_every_s=1800.0, checkpoint_s=30.0, group_nodes=2, stall_s=300.0, rejoin_s=30.0,
                      ft_overhead=1.25, samples=4)


def test_simulated_goodput_converges_to_the_closed_forms():
    c = cluster(OPTS, 64, 6.0)
    assert (c.nodes, c.groups) == (8, 4)
    horizon = OPTS.days * 86400
    rng = np.random.default_rng(0)
    plain, ft = [], []
    for _ in range(OPTS.samples):
        times, groups = draw_failures(rng, c, horizon)
        plain.append(simulate_checkpoint_restart(times, horizon, OPTS))
        ft.append(simulate_torchft(times, groups, horizon, c.groups, OPTS, OPTS.ft_overhead))
    # Both closed forms are far from 1 here (restarts and stalls matter), so agreement is not vacuous.
    assert closed_form_checkpoint_restart(c, OPTS) == pytest.approx(0.5510, abs=1e-3)
    assert np.mean(plain) == pytest.approx(closed_form_checkpoint_restart(c, OPTS), rel=0.01)
    assert closed_form_torchft(c, OPTS, OPTS.ft_overhead) * 1.25 < 0.9
    assert np.mean(ft) == pytest.approx(closed_form_torchft(c, OPTS, OPTS.ft_overhead), rel=0.002)


def test_without_failures_goodput_is_the_checkpoint_share():
    c = cluster(OPTS, 64, 6.0)
    none = np.array([])
    assert simulate_checkpoint_restart(none, 86400.0, OPTS) == pytest.approx(1800 / 1830, rel=1e-3)
    assert simulate_torchft(none, none.astype(int), 86400.0, c.groups, OPTS, 1.25) == pytest.approx(1800 / 1830 / 1.25)


def test_simulate_goodput_command_writes_its_table_and_json(tmp_path, capsys):
    out = tmp_path / "goodput.json"
    assert cli.main(["simulate", "goodput", "--gpus", "1000", "--node-mtbf-h", "5000", "--samples", "3",
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["gpus_modelled"] for r in rows] == [992]  # 31 groups of 4 nodes of 8 GPUs
    assert "| 1,000 | 5,000 h |" in capsys.readouterr().out
    assert cli.main(["simulate", "goodput", "--group-nodes", "0"]) == 2
