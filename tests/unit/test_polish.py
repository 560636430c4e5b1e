"""Polishing (solvers.polish): a recompute whose value can stay resident within the budget
is removed, its inputs recomputed only for it with it, and nothing else changes."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solvers import Graph, Schedule, keep_all_peak, simulate, validate
from solvers.polish import polish
from solvers.schedule import COMPUTE, FREE, schedule_from_order
from solvers.strategies import get_strategy
from solvers.strategies.auto import auto
from tests.graphs import chain, dropout6
from tests.unit.test_properties import _budget, training_graphs


def _first_order(schedule: Schedule) -> list[int]:
    seen: set[int] = set()
    out = []
    for op, i in schedule.steps:
        if op == COMPUTE and i not in seen:
            seen.add(i)
            out.append(i)
    return out


def _subsequence(short: Schedule, long: Schedule) -> bool:
    it = iter(long.steps)
    return all(step in it for step in short.steps)


def test_a_recompute_with_room_to_keep_its_value_is_removed() -> None:
    g = chain(3, training=True)  # f0 f1 f2 b2 b1 b0; b_i reads f_i
    recompute = schedule_from_order(g, [0, 1, 2, 3, 4, 0, 5])  # f0 freed after f1, made again for b0
    kept = schedule_from_order(g, [0, 1, 2, 3, 4, 5])
    assert simulate(g, recompute).peak < simulate(g, kept).peak  # the premise: keeping costs memory

    roomy = polish(g, recompute, keep_all_peak(g))
    assert roomy.merged == 1 and roomy.dropped == 0
    assert roomy.sim.cost == simulate(g, kept).cost == g.total_cost
    assert roomy.sim.peak <= keep_all_peak(g)
    assert _subsequence(roomy.schedule, recompute)

    tight = polish(g, recompute, simulate(g, recompute).peak)  # no room: nothing changes
    assert tight.merged == 0 and tight.schedule == recompute


def test_an_input_recomputed_only_for_a_removed_recompute_goes_with_it() -> None:
    # a -> b -> c (forward); d reads c, e reads b and d (backward). b is freed and made
    # again from a recomputed a: keeping b makes that a unread
    nodes = [
        {"key": "a", "cost": 1, "mem": 1},
        {"key": "b", "cost": 10, "mem": 1},
        {"key": "c", "cost": 1, "mem": 1},
        {"key": "d", "cost": 1, "mem": 1, "backward": True},
        {"key": "e", "cost": 1, "mem": 1, "backward": True},
    ]
    edges = [("a", "b"), ("b", "c"), ("c", "d"), ("b", "e"), ("d", "e")]
    g = Graph.build(nodes, edges, name="drop")
    a, b, c, d, e = range(5)
    steps = (
        (COMPUTE, a), (COMPUTE, b), (FREE, a), (COMPUTE, c), (FREE, b), (COMPUTE, d), (FREE, c),
        (COMPUTE, a), (COMPUTE, b), (FREE, a), (COMPUTE, e), (FREE, b), (FREE, d), (FREE, e),
    )  # fmt: skip
    given = Schedule(steps)
    assert validate(g, given).recomputes == 2

    out = polish(g, given, 3)
    assert (out.merged, out.dropped) == (1, 1)
    assert out.sim.recomputes == 0 and out.sim.cost == g.total_cost and out.sim.peak <= 3
    assert _first_order(out.schedule) == _first_order(given)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(training_graphs(), st.floats(0.0, 1.0))
def test_a_polished_schedule_is_valid_no_costlier_and_keeps_the_order_of_first_computes(
    g: Graph, frac: float
) -> None:
    budget = _budget(g, frac)
    for name in ("chen-greedy", "peak-greedy", "dtr", "dtr-lru", "checkpoint-last-node"):
        res = get_strategy(name)(g, budget, time_limit=5)
        if not res.ok or res.schedule is None:
            continue
        before = validate(g, res.schedule, budget)
        out = polish(g, res.schedule, budget)
        after = validate(g, out.schedule, budget)  # all computed, fixed nodes once, within budget
        assert after.cost <= before.cost + 1e-9 and after.cost == out.sim.cost, name
        assert after.recomputes == before.recomputes - out.merged - out.dropped, name
        assert _first_order(out.schedule) == _first_order(res.schedule), name
        assert _subsequence(out.schedule, res.schedule), name


def test_auto_polishes_a_schedule_planned_below_the_budget() -> None:
    # no heuristic fits 0.9 of 47.06 MiB on this graph; auto's ladder finds DTR without
    # banishing at 0.97 of it, whose plan leaves room that polishing spends on keeping values
    g = dropout6()
    budget = int(0.9 * 47.06 * 2**20)
    ladder = get_strategy("dtr")(g, int(budget * 0.97), banish=False)
    assert ladder.ok and ladder.schedule is not None and ladder.cost is not None

    out = polish(g, ladder.schedule, budget)
    assert out.merged > 0 and out.sim.peak <= budget
    assert out.sim.cost < 0.99 * ladder.cost

    res = auto(g, budget, time_limit=6, milp_max_nodes=0)
    assert res.ok and res.cost is not None and res.schedule is not None
    assert validate(g, res.schedule, budget).cost == res.cost <= out.sim.cost + 1e-9
    assert res.info["polished"], res.info["candidates"]
    # the option turns it off (make bench-polish compares the two)
    plain = auto(g, budget, time_limit=3, milp_max_nodes=0, polish=False)
    assert "polished" not in plain.info and plain.ok
