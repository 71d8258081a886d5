"""The pipeline simulator against closed forms (the 1F1B and interleaved bubbles), its sync counts per mode,
torch's own action orders, and `moetrain simulate --pp` end to end."""

import json
import math

import numpy as np
import pytest

from moetrain.bench.simulate import MODES, CommModel, Link, Workload, collective_times, main
from moetrain.bench.simulate_pipeline import (
    pipeline_step_times,
    schedule_order,
    simulate_pipeline,
    stage_costs_from_microbatches,
)
from moetrain.errors import ConfigError

FREE = CommModel(intra=Link(0.0, math.inf), inter=Link(0.0, math.inf))


def _equal_costs(pp: int, stages_per_rank: int, microbatches: int, lanes: int = 1) -> dict[str, np.ndarray]:
    # One second of forward and two of backward per stage and microbatch.
    return stage_costs_from_microbatches(np.full((1, microbatches, lanes), 3.0 * pp * stages_per_rank),
                                         pp * stages_per_rank)


@pytest.mark.parametrize("pp, microbatches", [(2, 2), (2, 5), (4, 4), (4, 8), (3, 7)])
def test_one_f_one_b_bubble_is_the_closed_form(pp, microbatches):
    times = simulate_pipeline(schedule_order("1F1B", pp, 1, microbatches), _equal_costs(pp, 1, microbatches))
    assert times.bubble_fraction[0] == pytest.approx((pp - 1) / (microbatches + pp - 1), rel=1e-12)
    # ... and the step is (m + p - 1) slots of one forward and one backward.
    assert times.step_s[0] == pytest.approx((microbatches + pp - 1) * 3.0)


@pytest.mark.parametrize("pp, stages_per_rank, microbatches", [(2, 2, 4), (4, 2, 8), (2, 3, 4)])
def test_interleaved_bubble_is_the_closed_form(pp, stages_per_rank, microbatches):
    # Narayanan et al. 2021: v stages per rank shrink the bubble to (p - 1) / (v m + p - 1).
    order = schedule_order("Interleaved1F1B", pp, stages_per_rank, microbatches)
    times = simulate_pipeline(order, _equal_costs(pp, stages_per_rank, microbatches))
    expected = (pp - 1) / (stages_per_rank * microbatches + pp - 1)
    assert times.bubble_fraction[0] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("schedule, pp, stages_per_rank, microbatches", [
    ("1F1B", 3, 1, 5), ("Interleaved1F1B", 2, 2, 4), ("ZBVZeroBubble", 2, 2, 4), ("ZBVZeroBubble", 4, 2, 8)])
def test_orders_run_every_action_once_on_the_stage_owner(schedule, pp, stages_per_rank, microbatches):
    order = schedule_order(schedule, pp, stages_per_rank, microbatches)
    actions = [a for acts in order.values() for a in acts]
    assert len(actions) == len(set(actions))
    n_stages = pp * stages_per_rank
    backward = {"B"} if schedule != "ZBVZeroBubble" else {"I", "W"}
    for kind in {"F"} | backward:
        assert {(a.stage, a.microbatch) for a in actions if a.kind == kind} == \
            {(s, i) for s in range(n_stages) for i in range(microbatches)}
    owner = {a.stage: rank for rank, acts in order.items() for a in acts}
    assert all(owner[a.stage] == rank for rank, acts in order.items() for a in acts)
    if schedule == "ZBVZeroBubble":  # the V: rank r holds stages r and 2 pp - 1 - r
        assert all(owner[s] == owner[2 * pp - 1 - s] == s for s in range(pp))
    # Torch's Schedule1F1B runs p - s warm-up forwards on stage s before its first backward.
    if schedule == "1F1B":
        for rank, acts in order.items():
            assert [a.kind for a in acts[:pp - rank + 1]] == ["F"] * (pp - rank) + ["B"]


@pytest.mark.parametrize("mode, all_reduces, reduce_scatters", [
    ("hsdp", 6, 6), ("hsdp-delayed", 1, 6), ("hsdp-final-only", 1, 1), ("fsdp", 0, 6)])
def test_sync_counts_per_stage_and_step(mode, all_reduces, reduce_scatters):
    microbatches, pp = 6, 2
    workload = Workload(layers=4, grad_bytes=1e6)
    times = pipeline_step_times(np.full((1, microbatches, 2), 0.1), schedule_order("1F1B", pp, 1, microbatches),
                                collective_times(mode, 2, 2, workload, FREE), MODES[mode].flags, workload.layers)
    assert times.all_reduces == dict.fromkeys(range(pp), all_reduces)
    assert times.reduce_scatters == dict.fromkeys(range(pp), reduce_scatters)


def test_every_microbatch_all_reduce_waits_where_delayed_does_not():
    # Two pipelines whose slow microbatches alternate: coupled at every backward, each waits for the
    # other's slow one; coupled once at the end, each only for its own sum.
    microbatches, pp = 4, 2
    compute = np.array([[[1.0, 4.0], [4.0, 1.0], [1.0, 4.0], [4.0, 1.0]]])
    order = schedule_order("1F1B", pp, 1, microbatches)
    workload = Workload(layers=2, grad_bytes=1e6)
    step = {mode: pipeline_step_times(compute, order, collective_times(mode, 2, 1, workload, FREE),
                                      MODES[mode].flags, workload.layers).step_s[0] for mode in MODES}
    alone = [pipeline_step_times(compute[:, :, [lane]], order, collective_times("hsdp", 1, 1, workload, FREE),
                                 MODES["hsdp"].flags, workload.layers).step_s[0] for lane in (0, 1)]
    # With free collectives the delayed all-reduce costs nothing: each pipeline runs as if alone.
    assert step["hsdp-delayed"] == pytest.approx(max(alone))
    assert step["hsdp-final-only"] == pytest.approx(max(alone))
    assert step["hsdp"] > 1.1 * step["hsdp-delayed"]
    # Coupling every backward on the elementwise slower microbatch is what every-microbatch sync costs here.
    slowest = pipeline_step_times(compute.max(axis=2, keepdims=True), order,
                                  collective_times("hsdp", 1, 1, workload, FREE), MODES["hsdp"].flags,
                                  workload.layers).step_s[0]
    assert step["hsdp"] == pytest.approx(slowest)


@pytest.mark.parametrize("args, match", [
    (("ZBVZeroBubble", 2, 2, 3), "2 pp"), (("Interleaved1F1B", 2, 2, 3), "multiple of pp"),
    (("1F1B", 4, 1, 3), "at least pp"), (("DualPipeV", 2, 2, 4), "pp_schedule"), (("1F1B", 1, 1, 4), "pp >= 2")])
def test_bad_schedules_fail_with_one_line(args, match):
    with pytest.raises(ConfigError, match=match) as err:
        schedule_order(*args)
    assert "\n" not in str(err.value)


def test_simulate_command_prints_the_bubble(tmp_path, capsys):
    out = tmp_path / "pp.json"
    argv = ["--replicate", "2", "--shard", "1", "--accum", "6", "--samples", "3", "--pp", "3",
            "--cost.distribution", "constant", "--workload.grad-bytes", "0", "--workload.layers", "3",
            "--comm.intra.alpha-s", "0", "--comm.inter.alpha-s", "0", "--json", str(out)]
    assert main(argv) == 0
    assert "bubble" in capsys.readouterr().out
    rows = json.loads(out.read_text())["modes"]
    for row in rows:  # equal costs, free collectives: every mode has the 1F1B bubble
        assert row["bubble_fraction"] == pytest.approx(2 / (6 + 2))
    with pytest.raises(ConfigError, match="no experts"):
        main(argv + ["--ep", "1", "2"])
