"""Graph reduction: the reduced optimum plus the offset equals the original optimum (exact
steps) or bounds it (restrictions); expanded schedules validate on the original graph."""

from __future__ import annotations

import numpy as np
import pytest

from solvers.api import memory_lower_bound
from solvers.errors import ScheduleError
from solvers.graph import Graph
from solvers.reduce import expand_schedule, reduce_graph
from solvers.schedule import Schedule, keep_all_peak, schedule_from_order, simulate, validate

from ._bruteforce import optimal_cost, random_dag


def views_graph() -> Graph:
    """a -> view(a) -> b -> c; const (no inputs, 0 bytes) -> c; loss-like sink reads b, c."""
    nodes = [
        {"key": "a", "cost": 2.0, "mem": 4},
        {"key": "va", "cost": 0.5, "mem": 0},
        {"key": "const", "cost": 0.25, "mem": 0},
        {"key": "b", "cost": 3.0, "mem": 4},
        {"key": "vb", "cost": 0.0, "mem": 0},
        {"key": "c", "cost": 1.0, "mem": 2},
        {"key": "mix", "cost": 0.0, "mem": 0},
    ]
    edges = [("a", "va"), ("va", "b"), ("b", "vb"), ("vb", "c"), ("const", "c"), ("b", "mix"), ("c", "mix")]
    return Graph.build(nodes, edges, order=["a", "va", "const", "b", "vb", "c", "mix"])


def test_zero_byte_fold_shrinks_and_expands() -> None:
    g = views_graph()
    red, inv = reduce_graph(g)
    names = [nd.name for nd in red.nodes]
    # va, const and vb fold (one live input at most); mix reads two live nodes: kept, and
    # computed once (zero bytes) like a, whose only reader folded
    assert names == ["a", "b", "c", "mix"]
    assert inv.exact
    assert inv.cost_offset == pytest.approx(0.75)
    assert red.meta["fixed_once"] == (red.index_of("a"), red.index_of("mix"))
    sched = schedule_from_order(red, range(red.n))
    full = expand_schedule(sched, inv)
    sim = validate(g, full, keep_all_peak(g))
    assert sim.cost == pytest.approx(simulate(red, sched).cost + inv.cost_offset)
    assert sim.peak == simulate(red, sched).peak
    assert sim.compute_counts.tolist() == [1] * g.n


def test_expand_rejects_out_of_order_first_computes() -> None:
    nodes = [{"key": k, "cost": 1.0, "mem": m} for k, m in (("p", 1), ("q", 1), ("v", 0), ("w", 1))]
    g = Graph.build(nodes, [("p", "v"), ("v", "w"), ("q", "w")])
    red, inv = reduce_graph(g)
    assert [nd.name for nd in red.nodes] == ["p", "q", "w"]
    # w computed before p: its folded input v has no place to run
    with pytest.raises(ScheduleError, match="zero-byte fold assumes"):
        expand_schedule(Schedule((("compute", 1), ("compute", 2), ("compute", 0))), inv)


@pytest.mark.parametrize("seed", range(10))
def test_fold_preserves_the_optimum(seed: int) -> None:
    g = random_dag(seed, 9, p_edge=0.25, zero_frac=0.3)
    red, inv = reduce_graph(g)
    assert inv.exact
    lo, hi = memory_lower_bound(g), keep_all_peak(g)
    for budget in sorted({lo, (lo + hi) // 2, hi}):
        want = optimal_cost(g, budget)
        got = optimal_cost(red, budget)
        if want is None:
            assert got is None
            continue
        assert got is not None
        assert got + inv.cost_offset == pytest.approx(want)


@pytest.mark.parametrize("seed", range(6))
def test_fixed_once_rows_are_exact_and_backward_once_bounds(seed: int) -> None:
    g = random_dag(seed, 8, p_edge=0.3, zero_frac=0.2, backward=True)
    red, inv = reduce_graph(g)
    fixed = np.zeros(red.n, dtype=bool)
    fixed[list(red.meta["fixed_once"])] = True
    pinned = _pin(red, fixed)
    red_b, inv_b = reduce_graph(g, backward_once=True)
    assert not inv_b.exact and "backward" in inv_b.restrictions[0]
    pinned_b = _pin(red_b, np.isin(np.arange(red_b.n), red_b.meta["fixed_once"]))
    lo, hi = memory_lower_bound(g), keep_all_peak(g)
    for budget in sorted({lo, (lo + hi) // 2}):
        want = optimal_cost(g, budget)
        exact = optimal_cost(pinned, budget)
        restricted = optimal_cost(pinned_b, budget)
        if want is None:
            assert exact is None and restricted is None
            continue
        assert exact is not None and exact + inv.cost_offset == pytest.approx(want)
        if restricted is not None:
            assert restricted + inv_b.cost_offset >= want - 1e-9


def test_cpsat_on_reduced_graph_expands_to_a_valid_schedule() -> None:
    pytest.importorskip("ortools")
    from solvers.strategies.cpsat import solve_cpsat

    for seed in range(4):
        g = random_dag(seed, 12, p_edge=0.2, zero_frac=0.3)
        red, inv = reduce_graph(g)
        budget = (memory_lower_bound(g) + keep_all_peak(g)) // 2
        res = solve_cpsat(red, budget, time_limit=10, backward_once=False)
        assert res.ok and res.schedule is not None
        sim = validate(g, expand_schedule(res.schedule, inv), budget)
        assert sim.cost == pytest.approx(simulate(red, res.schedule).cost + inv.cost_offset)
        assert sim.peak <= budget


def _pin(graph: Graph, fixed: np.ndarray) -> Graph:
    """The same graph with ``fixed`` nodes marked non-recomputable (the oracle's R rows)."""
    nodes = [
        {
            "key": nd.ext,
            "name": nd.name,
            "cost": nd.cost,
            "mem": nd.mem,
            "backward": nd.backward,
            "recomputable": nd.recomputable and not fixed[nd.id],
        }
        for nd in graph.nodes
    ]
    return Graph.build(
        nodes,
        [(graph.nodes[u].ext, graph.nodes[v].ext) for u, v in graph.edges],
        order=[nd.ext for nd in graph.nodes],
    )


def test_milp_optimum_is_preserved_when_the_milp_is_available() -> None:
    """The Checkmate MILP (HiGHS) on the reduced graph plus the offset equals its optimum
    on the original graph, and the expanded MILP schedule validates at the same budget."""
    from solvers.errors import CheckmateError
    from solvers.strategies import get_strategy

    try:
        ilp = get_strategy("ilp")
    except CheckmateError as exc:
        pytest.skip(f"the MILP strategy is not available: {exc}")
    for seed in range(3):
        g = random_dag(seed, 12, p_edge=0.2, zero_frac=0.3)
        red, inv = reduce_graph(g)
        assert red.n < g.n
        budget = (memory_lower_bound(g) + keep_all_peak(g)) // 2
        full = ilp(g, budget, time_limit=30)
        small = ilp(red, budget, time_limit=30)
        assert full.status.value == small.status.value == "optimal"
        assert small.cost is not None and small.schedule is not None
        assert small.cost + inv.cost_offset == pytest.approx(full.cost)
        sim = validate(g, expand_schedule(small.schedule, inv), budget)
        assert sim.cost == pytest.approx(full.cost)
