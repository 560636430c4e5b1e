"""LP relaxation + two-phase rounding, and the properties tying it to the MILP."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solvers import Graph, Status, highs, keep_all_peak, memory_lower_bound, validate
from solvers.duals import lagrangian_bound
from solvers.formulation import formulate, liveness_masks, problem_of
from solvers.schedule import schedule_from_rs
from solvers.stages import closure_r, complete_rs, rs_cost
from solvers.strategies import get_strategy
from solvers.strategies.ilp import ilp
from solvers.strategies.lp_rounding import lp_rounding, round_threshold_sweep, thresholds_for
from tests.graphs import chain
from tests.unit.test_ilp import dags, sched, training_chain3

from ._bruteforce import optimal_cost

LIMIT = 20.0


def test_rounding_known_answers() -> None:
    g = training_chain3()
    res = get_strategy("lp-rounding")(g, 4, time_limit=LIMIT)
    # budget = keep-all peak: the LP bound is the no-recompute cost and rounding meets it
    assert res.status == Status.OPTIMAL and res.cost == 6 and res.lower_bound == pytest.approx(6)
    res = lp_rounding(g, 3, time_limit=LIMIT)
    assert res.ok and res.cost is not None and res.cost >= 7
    validate(g, sched(res), 3)
    assert res.lower_bound is not None and 6 <= res.lower_bound <= 7 + 1e-6


def test_rounding_reports_infeasible_below_the_cheap_bound(diamond: Graph) -> None:
    res = lp_rounding(diamond, memory_lower_bound(diamond) - 1, time_limit=LIMIT)
    assert res.status == Status.INFEASIBLE and res.info["min_budget"] == memory_lower_bound(diamond)


def test_closure_is_the_minimal_r() -> None:
    g = chain(6, training=True)
    n = g.n
    # nothing kept: every stage recomputes its node's whole ancestry
    R = closure_r(g, np.zeros((n, n), dtype=bool))
    anc: list[set[int]] = [set() for _ in range(n)]
    for v in range(n):
        for p in g.preds[v]:
            anc[v] |= anc[p] | {p}
    for t in range(n):
        assert set(np.flatnonzero(R[t]).tolist()) == anc[t] | {t}
    # everything that is ever read kept: no recomputation at all
    R, S = complete_rs(g, np.tri(n, k=-1, dtype=bool))
    assert rs_cost(g, R) == g.total_cost
    validate(g, schedule_from_rs(g, R, S))


def test_threshold_sweep_keeps_the_cheapest_fitting_pattern() -> None:
    g = chain(10, training=True)
    rng = np.random.default_rng(1)
    S_frac = rng.random((g.n, g.n)) * np.tri(g.n, k=-1)
    sims = [validate(g, schedule_from_rs(g, *complete_rs(g, S_frac >= th))) for th in thresholds_for(S_frac)]
    budget = int(np.median([s.peak for s in sims]))  # some patterns fit, some do not
    assert min(s.peak for s in sims) <= budget < max(s.peak for s in sims)
    found = round_threshold_sweep(g, budget, S_frac)
    assert found is not None
    R, S, cost, theta = found
    assert validate(g, schedule_from_rs(g, R, S), budget).cost == cost
    assert cost == min(s.cost for s in sims if s.peak <= budget)
    assert theta in thresholds_for(S_frac)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(max_n=10), st.floats(0.5, 1.0))
def test_lp_bound_milp_and_rounding_are_ordered(g: Graph, frac: float) -> None:
    peak = keep_all_peak(g)
    # at the keep-all peak the MILP pays exactly the no-recompute cost
    full = ilp(g, peak, time_limit=LIMIT)
    assert full.status == Status.OPTIMAL and full.cost == pytest.approx(g.total_cost)
    budget = max(int(frac * peak), memory_lower_bound(g))
    mip = ilp(g, budget, time_limit=LIMIT)
    rounded = lp_rounding(g, budget, time_limit=LIMIT)
    if mip.status == Status.INFEASIBLE:
        assert not rounded.ok
        # the exhaustive oracle (same stage structure) agrees that nothing fits
        assert optimal_cost(g, budget, staged=True) is None
        return
    assert mip.status == Status.OPTIMAL and mip.cost is not None
    assert validate(g, sched(mip), budget).cost == pytest.approx(mip.cost)
    assert rounded.lower_bound is not None
    assert rounded.lower_bound <= mip.cost * (1 + 1e-6) + 1e-9
    assert mip.lower_bound is not None and mip.lower_bound <= mip.cost * (1 + 1e-6) + 1e-9
    if rounded.ok:
        assert validate(g, sched(rounded), budget).cost == pytest.approx(rounded.cost)
        assert rounded.cost is not None and rounded.cost >= mip.cost * (1 - 1e-6)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(max_n=10), st.floats(0.5, 1.0), st.integers(0, 2**32 - 1))
def test_lagrangian_bound_is_valid_for_any_duals(g: Graph, frac: float, seed: int) -> None:
    budget = max(int(frac * keep_all_peak(g)), memory_lower_bound(g))
    full = formulate(g, budget)
    res = highs.solve(problem_of(full), relax=True, time_limit=LIMIT)
    assert res.status in (Status.OPTIMAL, Status.INFEASIBLE), res.status
    if res.status == Status.INFEASIBLE:  # an infeasible LP: the MILP must be infeasible too
        assert ilp(g, budget, time_limit=LIMIT).status == Status.INFEASIBLE
        assert optimal_cost(g, budget, staged=True) is None
        return
    assert res.objective is not None and res.row_dual is not None
    # the LP's own duals reproduce its optimum; any other duals bound it from below
    assert lagrangian_bound(full, full.row_key, res.row_dual) == pytest.approx(res.objective, abs=1e-6)
    noise = np.random.default_rng(seed).normal(size=full.num_constraints)
    assert lagrangian_bound(full, full.row_key, noise) <= res.objective + 1e-6
    # duals of the restricted (liveness) model bound the full LP too
    small = formulate(g, budget, support=liveness_masks(g))
    sres = highs.solve(problem_of(small), relax=True, time_limit=LIMIT)
    if sres.row_dual is not None:
        assert lagrangian_bound(full, small.row_key, sres.row_dual) <= res.objective + 1e-6
        assert sres.objective is not None and sres.objective >= res.objective - 1e-6


def test_restricted_lp_is_certified_on_unet() -> None:
    from tests.graphs import public_graph

    g = public_graph("vgg_unet_b32_416x608.json")
    budget = int(0.6 * keep_all_peak(g))
    full_lp = ilp(g, budget, relax=True, time_limit=120)
    res = lp_rounding(g, budget, time_limit=120)
    assert res.info["num_vars"] < 0.7 * res.info["full_num_vars"]
    assert res.info["lp_certified"] is True
    assert res.lower_bound == pytest.approx(full_lp.lower_bound, rel=1e-7)
    assert res.ok and res.cost is not None and res.lower_bound is not None
    assert res.cost <= 1.02 * res.lower_bound
