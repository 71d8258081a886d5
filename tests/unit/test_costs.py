"""Cost draws shared by `bench sync` and `simulate`: determinism, group sharing, moments, closed forms."""

import math

import numpy as np
import pytest

from moetrain.bench.costs import (
    CostSpec,
    as_batch_sizes,
    costs_per_rank,
    draw_costs,
    expected_max_of_sum_bimodal,
    expected_sum_of_max_bimodal,
    replica_group_of,
)
from moetrain.errors import ConfigError

BIMODAL = CostSpec("bimodal", short=0.04, ratio=4.0, p_long=0.5)


def test_same_seed_same_costs_and_steps_do_not_depend_on_run_length():
    a = draw_costs(BIMODAL, seed=3, steps=10, accum=4, groups=2)
    b = draw_costs(BIMODAL, seed=3, steps=10, accum=4, groups=2)
    short_run = draw_costs(BIMODAL, seed=3, steps=4, accum=4, groups=2)
    tail = draw_costs(BIMODAL, seed=3, steps=6, accum=4, groups=2, first_step=4)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[:4], short_run)
    np.testing.assert_array_equal(a[4:], tail)
    assert not np.array_equal(a, draw_costs(BIMODAL, seed=4, steps=10, accum=4, groups=2))
    assert a.shape == (10, 4, 2)
    assert set(np.unique(a)) <= {0.04, 0.16}


def test_ranks_of_one_replica_group_share_its_cost():
    groups, shard = 3, 4
    costs = draw_costs(CostSpec("lognormal", 1.0, cv=0.7), seed=0, steps=5, accum=2, groups=groups)
    per_rank = costs_per_rank(costs, shard)
    assert per_rank.shape == (5, 2, groups * shard)
    for rank in range(groups * shard):
        group = replica_group_of(rank, shard)
        assert group == rank // shard
        np.testing.assert_array_equal(per_rank[..., rank], costs[..., group])
    # Different groups do draw different costs (lognormal: ties have probability zero).
    assert not np.array_equal(costs[..., 0], costs[..., 1])


@pytest.mark.parametrize("spec", [BIMODAL, CostSpec("bimodal", 2.0, ratio=3.0, p_long=0.2),
                                  CostSpec("lognormal", 0.1, cv=0.5), CostSpec("constant", 0.07)])
def test_sample_moments_match_the_spec(spec):
    costs = draw_costs(spec, seed=1, steps=2000, accum=8, groups=8)  # 128k draws
    assert costs.mean() == pytest.approx(spec.mean(), rel=0.01)
    assert costs.std() == pytest.approx(spec.std(), rel=0.02, abs=1e-12)


def test_closed_forms_match_monte_carlo_for_bimodal():
    rng = np.random.default_rng(0)
    spec = CostSpec("bimodal", short=1.0, ratio=4.0, p_long=0.3)
    for accum, groups in [(4, 2), (8, 2), (3, 5)]:
        costs = np.where(rng.random((200_000, accum, groups)) < spec.p_long, spec.long, spec.short)
        sum_of_max = costs.max(axis=2).sum(axis=1).mean()
        max_of_sum = costs.sum(axis=1).max(axis=1).mean()
        assert expected_sum_of_max_bimodal(spec, accum, groups) == pytest.approx(sum_of_max, rel=0.005)
        assert expected_max_of_sum_bimodal(spec, accum, groups) == pytest.approx(max_of_sum, rel=0.005)
    # One group: no waiting at all, both equal the plain expectation.
    assert expected_sum_of_max_bimodal(spec, 6, 1) == pytest.approx(6 * spec.mean())
    assert expected_max_of_sum_bimodal(spec, 6, 1) == pytest.approx(6 * spec.mean())


def test_batch_sizes_are_whole_and_positive():
    sizes = as_batch_sizes(np.array([0.2, 1.4, 2.6, 7.0]))
    assert sizes.dtype == np.int64
    assert sizes.tolist() == [1, 1, 3, 7]


@pytest.mark.parametrize("spec, match", [
    (CostSpec("uniform"), "distribution"),
    (CostSpec(short=0.0), "short"),
    (CostSpec(short=math.inf), "short"),
    (CostSpec(ratio=0.5), "ratio"),
    (CostSpec(p_long=1.5), "p_long"),
    (CostSpec(cv=-0.1), "cv"),
])
def test_bad_specs_raise_one_line_config_errors(spec, match):
    with pytest.raises(ConfigError, match=match) as err:
        draw_costs(spec, 0, 1, 1, 1)
    assert "\n" not in str(err.value)


def test_bad_shapes_raise():
    with pytest.raises(ConfigError, match="accum"):
        draw_costs(BIMODAL, 0, steps=1, accum=0, groups=2)
