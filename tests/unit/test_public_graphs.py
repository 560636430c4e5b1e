"""Known answers on the public Checkmate graphs (benchmarks/graphs).

Two independent formulations in the literature (Checkmate's MILP, Moccasin's CP-SAT) agree
on VGG16 at 0.9 of the keep-all peak: 1.0197x the no-recompute cost. VGG19 at 0.8 is about
1.028x. VGG16 has no schedule at 0.8 (its largest op working set is 0.831 of the peak).
"""

from __future__ import annotations

import pytest

from solvers import InfeasibleBudgetError, Status, highs, keep_all_peak, solve, validate
from solvers.formulation import formulate, problem_of
from solvers.strategies.ilp import ilp
from solvers.strategies.lp_rounding import lp_rounding
from tests.graphs import public_graph
from tests.unit.test_ilp import sched

VGG16 = "VGG16_b256_224x224.json"
VGG19 = "VGG19_b256_224x224.json"
LIMIT = 120.0


@pytest.mark.parametrize(
    ("name", "frac", "ratio", "tol"), [(VGG16, 0.9, 1.0197, 5e-5), (VGG19, 0.8, 1.028, 1e-3)]
)
def test_milp_and_rounding_on_vgg(name: str, frac: float, ratio: float, tol: float) -> None:
    g = public_graph(name)
    res = solve(g, frac, "ilp", time_limit=LIMIT)
    budget = res.budget
    assert budget == int(frac * keep_all_peak(g))
    assert res.status == Status.OPTIMAL
    assert res.cost is not None and res.cost / g.total_cost == pytest.approx(ratio, abs=tol)
    assert validate(g, sched(res), budget).peak <= budget
    rounded = lp_rounding(g, budget, time_limit=LIMIT)
    assert rounded.ok and rounded.cost is not None
    assert rounded.cost <= 1.10 * res.cost
    validate(g, sched(rounded), budget)
    # the LP objective is a lower bound on the optimum
    assert rounded.lower_bound is not None and g.total_cost <= rounded.lower_bound <= res.cost


def test_vgg16_at_80_percent_is_infeasible() -> None:
    g = public_graph(VGG16)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(g, 0.8, "ilp", time_limit=LIMIT)
    exc = info.value  # proven below the bound, and a schedule found at the minimum stated
    assert exc.proven and exc.minimum is not None and exc.budget < exc.lower_bound <= exc.minimum
    assert solve(g, exc.minimum, "auto", time_limit=LIMIT).ok
    res = solve(g, 0.8, "ilp", time_limit=LIMIT, raise_infeasible=False)
    assert res.status == Status.INFEASIBLE
    # the MILP on its own (no cheap bound in front of it) proves it too
    model = formulate(g, int(0.8 * keep_all_peak(g)))
    assert highs.solve(problem_of(model), time_limit=LIMIT).status == Status.INFEASIBLE


def test_warm_started_milp_keeps_the_rounded_incumbent() -> None:
    g = public_graph(VGG16)
    budget = int(0.9 * keep_all_peak(g))
    rounded = lp_rounding(g, budget, time_limit=LIMIT)
    res = ilp(g, budget, time_limit=LIMIT, warm_start=rounded.schedule)
    assert res.info["warm_start"] is True and res.status == Status.OPTIMAL
    assert res.cost is not None and rounded.cost is not None and res.cost <= rounded.cost


def test_no_plan_names_the_closest_budget_that_has_one() -> None:
    """Without a schedule, the least peak an attempt over the budget reached is reported,
    and it is a budget at which that attempt is a valid plan."""
    from solvers.api import closest_hint

    g = public_graph("random_layered_n100.json")
    res = solve(g, 0.65, "peak-greedy", raise_infeasible=False)
    assert res.status == Status.NO_SOLUTION and res.schedule is not None and res.peak is not None
    assert res.peak > res.budget
    validate(g, res.schedule, res.peak)  # a plan at its own peak
    hint = closest_hint(res)
    assert f"{res.peak:,} bytes" in hint and "peak-greedy" in hint

    auto = solve(g, 0.65, "auto", time_limit=2.0, milp_max_nodes=0, raise_infeasible=False)
    assert auto.schedule is None
    closest = auto.info["closest_peak"]
    assert res.budget < closest <= res.peak  # peak-greedy's attempt, or a closer one
    assert f"{closest:,} bytes" in closest_hint(auto)
    assert closest_hint(solve(g, 1.0, "checkpoint-all")) == ""  # a plan: nothing to add


def test_auto_above_the_milp_size_improves_the_incumbent_with_cpsat() -> None:
    pytest.importorskip("ortools")
    g = public_graph("MobileNet_b512_224x224.json")
    greedy = solve(g, 0.6, "peak-greedy")
    res = solve(g, 0.6, "auto", time_limit=20.0, milp_max_nodes=100)
    cands = res.info["candidates"]
    assert "cpsat" in cands and "lp-rounding" not in cands and "ilp" not in cands, cands
    assert res.ok and res.cost is not None and greedy.cost is not None
    assert res.cost <= greedy.cost + 1e-9
    validate(g, res.schedule, res.budget)
