"""The recompute lower bound: never above the exhaustive optimum, and above the trivial
bound (every op once) where a budget forces recomputation."""

from __future__ import annotations

import pytest

from solvers import keep_all_peak
from solvers.bounds import memory_lower_bound
from solvers.cost_bounds import recompute_lower_bound
from tests.graphs import chain

from ._bruteforce import optimal_cost, random_dag


def test_below_the_optimum_on_random_dags() -> None:
    above_trivial = 0
    for seed in range(30):
        g = random_dag(seed, 8, backward=True)
        keep = keep_all_peak(g)
        for budget in range(max(memory_lower_bound(g) - 2, 0), keep + 1):
            best = optimal_cost(g, budget)
            bound = recompute_lower_bound(g, budget)
            if bound is None:  # it claims no schedule fits: the oracle agrees
                assert best is None, (seed, budget)
                continue
            assert bound >= g.total_cost
            if best is not None:
                assert bound <= best + 1e-9, (seed, budget, bound, best)
                above_trivial += bound > g.total_cost + 1e-9
    assert above_trivial >= 20  # not just the trivial bound


def test_a_training_chain_by_hand() -> None:
    # chain(4, training=True): forward a0..a3 (unit cost and size), backward reads them in
    # reverse; at the first backward op all four forward values are live and needed
    g = chain(4, training=True)
    assert recompute_lower_bound(g, keep_all_peak(g)) == pytest.approx(g.total_cost)
    tight = recompute_lower_bound(g, keep_all_peak(g) - 1)
    assert tight is not None and tight >= g.total_cost + 1.0 - 1e-9  # one value recomputed
    best = optimal_cost(g, keep_all_peak(g) - 1)
    assert best is not None and tight <= best
