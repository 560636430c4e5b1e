"""A bound on what a plan holds at its forward/backward boundary (solvers.boundary): the
ballast construction, and plans that honour it, checked against an exhaustive oracle."""

from __future__ import annotations

import pytest

from solvers import solve
from solvers.boundary import (
    BALLAST,
    HOLD,
    boundary_hold,
    forward_peak,
    retained_peaks,
    with_ballast,
    with_forward_hold,
    without_ballast,
)
from solvers.budget import Budget
from solvers.errors import BudgetError, InfeasibleBudgetError
from solvers.graph import Graph, Node
from solvers.schedule import Schedule, keep_all_peak, schedule_from_order, simulate, validate
from tests.graphs import chain

from ._bruteforce import optimal_cost, random_dag


def test_the_ballast_sits_before_the_backward_and_its_first_op_reads_it() -> None:
    g = random_dag(3, 8, backward=True)
    held, at = with_ballast(g, 20, 12)
    assert at == g.first_backward
    assert held.n == g.n + 1 and held.nodes[at].name == BALLAST and held.backward_mask[at]
    assert held.succs[at] == (at + 1,) and not held.preds[at]
    assert held.mem[at] == 20 - 12 - int(g.mem[at])
    # every other node and edge is the original's, moved past the ballast
    assert [nd.name for k, nd in enumerate(held.nodes) if k != at] == [nd.name for nd in g.nodes]
    keep_all = solve(held, 10**6, "checkpoint-all")
    back = without_ballast(keep_all.schedule, at)
    assert simulate(g, back).cost == pytest.approx(g.total_cost)
    validate(g, back)


def test_a_training_chain_holds_less_at_the_boundary_at_a_cost() -> None:
    # 8 unit forward values and their gradients (keep-all peak 9): the cheapest plan within
    # 7 bytes keeps 6 of them at the boundary; held to 4 there, it recomputes more
    g = chain(8, training=True)
    free = solve(g, 7, "ilp", time_limit=30)
    assert boundary_hold(g, free.schedule) == 6
    for boundary in (5, 4, 3):
        res = solve(g, Budget(nbytes=7, boundary=boundary), "ilp", time_limit=30)
        assert res.ok and res.peak is not None and res.peak <= 7
        assert boundary_hold(g, res.schedule) == boundary  # the bound binds: no plan holds more
        assert res.cost == pytest.approx(optimal_cost(g, 7, staged=True, boundary=boundary))
        assert res.cost > free.cost
        assert res.info["boundary"] == boundary


@pytest.mark.parametrize("seed", range(6))
def test_the_milp_with_a_boundary_agrees_with_brute_force(seed: int) -> None:
    # at the keep-all peak and one byte below it, every boundary below the cheapest plan's
    # hold, down to the first that no plan reaches
    g = random_dag(seed, 8, backward=True)
    for peak in (keep_all_peak(g), keep_all_peak(g) - 1):
        free = solve(g, peak, "ilp", time_limit=30, raise_infeasible=False)
        if not free.ok:
            continue
        for boundary in range(boundary_hold(g, free.schedule) - 1, -1, -1):
            asked = Budget(nbytes=peak, boundary=boundary)
            want = optimal_cost(g, peak, staged=True, boundary=boundary)
            if want is None:
                with pytest.raises(InfeasibleBudgetError, match="boundary"):
                    solve(g, asked, "ilp", time_limit=30)
                break
            res = solve(g, asked, "ilp", time_limit=30)
            assert res.cost == pytest.approx(want)
            assert boundary_hold(g, res.schedule) <= boundary


@pytest.mark.parametrize("strategy", ["auto", "dtr", "peak-greedy", "lp-rounding", "cpsat"])
def test_every_strategy_plans_within_the_boundary(strategy: str) -> None:
    g = chain(12, training=True)
    res = solve(g, Budget(nbytes=9, boundary=5), strategy, time_limit=20)
    # solve() checks the bound on every plan (SolverError otherwise); each strategy finds one here
    assert res.ok, res.status
    assert res.peak is not None and res.peak <= 9
    assert boundary_hold(g, res.schedule) <= 5


def test_a_boundary_no_plan_reaches_names_it() -> None:
    g = chain(6, training=True)
    with pytest.raises(InfeasibleBudgetError, match="at most 0 B at its forward/backward boundary"):
        solve(g, Budget(nbytes=6, boundary=0), "ilp", time_limit=10)


def test_a_boundary_at_or_above_the_peak_budget_changes_nothing() -> None:
    g = chain(6, training=True)
    assert solve(g, Budget(nbytes=6, boundary=6), "ilp").cost == solve(g, 6, "ilp").cost


def test_a_boundary_needs_bytes_beside_a_byte_or_fraction_budget() -> None:
    with pytest.raises(BudgetError, match="boundary"):
        Budget(least=True, boundary=10)
    with pytest.raises(BudgetError, match="boundary"):
        Budget(nbytes=10, boundary=-1)
    assert Budget(fraction=0.5, boundary=10).for_graph(100, 4) == Budget(nbytes=46, reference=100, boundary=6)
    assert "at most 1.00 KiB at the boundary" in str(Budget(nbytes=4096, boundary=1024))


def test_the_simulator_records_the_boundary_hold() -> None:
    # keep-all on the training chain: the 8 forward values are resident when b7 starts;
    # a graph without a backward holds at its end what it holds
    g = chain(8, training=True)
    sim = simulate(g, solve(g, 1.0, "checkpoint-all").schedule)
    assert sim.boundary == 8 and sim.peak == 9
    fwd = chain(5)
    steps = solve(fwd, 1.0, "checkpoint-all").schedule
    assert simulate(fwd, steps).boundary == simulate(fwd, steps).timeline[-1]


# ------------------------------------------------------- memory held through the forward only


def test_the_forward_hold_is_made_first_kept_and_read_by_the_first_backward_op() -> None:
    g = random_dag(4, 8, backward=True)
    held = with_forward_hold(g, 5)
    assert held.n == g.n + 1 and held.nodes[0].name == HOLD and held.mem[0] == 5
    assert not held.nodes[0].recomputable and not held.backward_mask[0]
    assert held.succs[0] == (g.first_backward + 1,) and held.first_backward == g.first_backward + 1
    assert [nd.name for nd in held.nodes[1:]] == [nd.name for nd in g.nodes]
    keep_all = solve(held, 10**6, "checkpoint-all")
    back = without_ballast(keep_all.schedule, 0)
    validate(g, back)
    # the original's forward holds what the held graph's does, less the hold
    assert forward_peak(g, back) + 5 == forward_peak(held, keep_all.schedule)


def _big_gradient_first() -> Graph:
    """Four unit forward values, then a backward that starts with the loss's gradient (0 bytes)
    and next makes a 4-byte value (a logits-sized gradient): keeping every value peaks at 8 in
    the backward, 4 in the forward."""
    nodes = [Node(i, f"f{i}", 1.0, 1) for i in range(4)] + [Node(4, "b0", 1.0, 0, backward=True)]
    nodes += [Node(5, "b1", 1.0, 4, backward=True)] + [
        Node(6 + k, f"b{k + 2}", 1.0, 1, backward=True) for k in range(3)
    ]
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (3, 5), (4, 5), (5, 6), (2, 6), (6, 7), (1, 7), (7, 8), (0, 8)]
    return Graph(tuple(nodes), tuple(edges), name="big-gradient-first")


@pytest.mark.parametrize("strategy", ["ilp", "auto", "peak-greedy", "lp-rounding", "cpsat"])
def test_the_strategies_plan_a_forward_that_fits_beside_a_hold(strategy: str) -> None:
    # 3 bytes held through the forward only fit beside keeping every value within 8 (the
    # forward holds 4, the backward 8 once they are freed); held through the whole step, no
    # plan fits (the backward needs 6 at the least). DTR, an online eviction, finds none here
    # ("8 bytes in use are locked or not recomputable"): the planner then tries the others
    g = _big_gradient_first()
    res = solve(with_forward_hold(g, 3), 8, strategy, time_limit=20)
    assert res.ok, res.status
    back = without_ballast(res.schedule, 0)
    validate(g, back, 8)
    assert forward_peak(g, back) + 3 <= 8
    if strategy == "ilp":
        assert simulate(g, back).cost == g.total_cost  # nothing recomputed
        with pytest.raises(InfeasibleBudgetError):
            solve(g, 8 - 3, "ilp", time_limit=30)


def test_a_backward_run_again_holds_what_the_forward_saved_and_the_last_the_gradients() -> None:
    # a 3-layer training chain of unit values kept whole peaks at 4 (f0-f2 and b2). Run as
    # two backwards through one forward (retain_graph=True), the first holds f0-f2 to its
    # end: 5 after b1; the last frees them as planned, beside the first's gradients (3)
    g = chain(3, training=True)
    keep = schedule_from_order(g, range(g.n))
    assert simulate(g, keep).peak == 4
    assert retained_peaks(g, keep, 3, backwards=1) == (4, 4)  # one backward: the plan's own
    assert retained_peaks(g, keep, 0, backwards=2) == (5, 4)
    assert retained_peaks(g, keep, 3, backwards=2) == (5, 7)
    assert retained_peaks(g, keep, 3, backwards=3) == (8, 7)  # the middle one beside both
    # f1 freed unread as the backward starts and recomputed for b1: the backward's own copy,
    # not one the forward saved (held, it would count 6 as b1 runs)
    steps = (("compute", 0), ("compute", 1), ("compute", 2), ("compute", 3), ("free", 2), ("free", 1))
    steps += (
        ("compute", 1),
        ("compute", 4),
        ("free", 1),
        ("free", 3),
        ("compute", 5),
        ("free", 0),
        ("free", 4),
    )
    validate(g, Schedule(steps))
    assert retained_peaks(g, Schedule(steps), 0, backwards=2) == (5, 4)
