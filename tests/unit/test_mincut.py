"""min-cut: the cut is the least ``kept bytes + rate * recompute cost`` (checked against
every kept set of small graphs), and the sweep's schedule is the cheapest it simulated."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solvers import Graph, Status, keep_all_peak, simulate, validate
from solvers.strategies import get_strategy
from solvers.strategies._segments import forced_keep, forward_ids, schedule_from_kept
from solvers.strategies.mincut import kept_by_cut
from tests.graphs import chain
from tests.unit.test_dtr import training_graph
from tests.unit.test_properties import training_graphs


def _price(g: Graph, kept: set[int], rate: float) -> float:
    """``kept bytes + rate * recompute cost`` of computing ``kept`` in the forward only:
    the other forward values the backward needs are recomputed (with what they read that
    is not kept), and what they and the backward read from ``kept`` is held."""
    back = g.backward_mask
    need = {u for u, v in g.edges if back[v] and not back[u]}
    recompute: set[int] = set()
    stack = [u for u in need if u not in kept]
    while stack:
        v = stack.pop()
        if v in recompute:
            continue
        recompute.add(v)
        stack.extend(p for p in g.preds[v] if p not in kept)
    held = {u for u in need if u in kept} | {p for v in recompute for p in g.preds[v] if p in kept}
    return float(sum(int(g.mem[u]) for u in held)) + rate * float(sum(g.cost[v] for v in recompute))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(training_graphs(max_fwd=9), st.sampled_from([0.0, 0.05, 0.3, 1.0, 4.0, 30.0]))
def test_the_cut_is_the_cheapest_kept_set(g: Graph, rate: float) -> None:
    fwd = forward_ids(g).tolist()
    pinned = {int(v) for v in np.flatnonzero(forced_keep(g)) if not g.backward_mask[v]}
    free = [v for v in fwd if v not in pinned]
    best = min(
        _price(g, pinned | set(extra), rate)
        for r in range(len(free) + 1)
        for extra in itertools.combinations(free, r)
    )
    got = _price(g, {int(v) for v in kept_by_cut(g, rate)}, rate)
    # capacities are scaled to integers: equal up to that rounding
    assert got == pytest.approx(best, rel=1e-6, abs=1e-6)


def test_rates_move_from_fewest_bytes_to_keeping_everything() -> None:
    g = chain(6, training=True)  # unit costs and sizes: each value is read by its gradient
    assert kept_by_cut(g, float("inf")).tolist() == forward_ids(g).tolist()
    # a chain's backward reads every forward value: keeping one byte saves a unit of
    # recompute and more, so at rates above 1 everything is kept; at 0, the fewest bytes
    assert kept_by_cut(g, 2.0).tolist() == forward_ids(g).tolist()
    few = kept_by_cut(g, 0.0).tolist()
    assert len(few) < 6 and set(few) >= {int(v) for v in np.flatnonzero(forced_keep(g)) if v < 6}


def _layered(n: int = 12) -> Graph:
    """A training chain whose every third op is a costly product (cost 20) and the others
    cheap pointwise ops (cost 1), all 4 bytes: what a cut separates."""
    costs = [20.0 if i % 3 == 0 else 1.0 for i in range(n)] + [2.0] * n
    return training_graph(n, [(i, i + 1) for i in range(n - 1)], costs, [4] * (2 * n))


def test_the_sweep_fits_a_budget_below_keep_all_recomputing_cheap_ops_only() -> None:
    g = _layered()
    ref = keep_all_peak(g)
    budget = int(0.75 * ref)
    res = get_strategy("mincut")(g, budget)
    assert res.status == Status.FEASIBLE and res.schedule is not None
    sim = validate(g, res.schedule, budget)
    assert sim.peak <= budget < ref and sim.recomputes > 0
    again = np.flatnonzero(sim.compute_counts > 1)
    assert all(g.cost[v] == 1.0 for v in again), "a costly product was recomputed"
    # the sweep returns the cheapest of the kept sets it simulated
    for rate in (0.0, 0.5, 1.0, 2.0):
        other = simulate(g, schedule_from_kept(g, kept_by_cut(g, rate).tolist()))
        if other.peak <= budget:
            assert sim.cost <= other.cost + 1e-9


def test_below_the_fewest_bytes_it_says_so_with_its_least_peak() -> None:
    g = chain(12, training=True)
    res = get_strategy("mincut")(g, 1)
    assert res.status == Status.NO_SOLUTION and res.peak is not None and res.peak > 1
    assert "over the budget" in res.info["message"]
