"""The one simulator, the (R, S) decoder and the order-based schedule builder."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers import (
    Graph,
    ScheduleError,
    keep_all_peak,
    schedule_from_order,
    schedule_from_rs,
    simulate,
    validate,
)
from tests.graphs import chain


def test_simulator_counts_output_before_freeing_inputs(diamond: Graph) -> None:
    # a(4) b(2) c(3) d(1): compute all, free each after its last read.
    steps = [
        ("compute", 0),
        ("compute", 1),
        ("compute", 2),
        ("free", 0),
        ("compute", 3),
        ("free", 1),
        ("free", 2),
        ("free", 3),
    ]
    res = simulate(diamond, steps)
    assert res.cost == 10
    # after computing c: a+b+c = 9; after d: b+c+d = 6
    assert res.peak == 9 and res.peak_step == 2
    assert list(res.timeline) == [4, 6, 9, 5, 6, 4, 1, 0]
    assert res.resident_end == frozenset()


def test_simulator_rejects_invalid_steps(diamond: Graph) -> None:
    with pytest.raises(ScheduleError, match=r"input 'a' is not resident"):
        simulate(diamond, [("compute", 1)])
    with pytest.raises(ScheduleError, match="already resident"):
        simulate(diamond, [("compute", 0), ("compute", 0)])
    with pytest.raises(ScheduleError, match="not resident"):
        simulate(diamond, [("free", 0)])
    with pytest.raises(ScheduleError, match="does not exist"):
        simulate(diamond, [("compute", 9)])
    with pytest.raises(ScheduleError, match="unknown op"):
        simulate(diamond, [("load", 0)])


def test_validate_rules(diamond: Graph) -> None:
    full = schedule_from_order(diamond, range(4))
    assert validate(diamond, full, 9).peak == 9
    with pytest.raises(ScheduleError, match="exceeds the budget"):
        validate(diamond, full, 8)
    with pytest.raises(ScheduleError, match="never computes"):
        validate(diamond, schedule_from_order(diamond, [0, 1]))
    pinned = Graph(
        tuple(nd if nd.id else type(nd)(0, "a", 1, 4, recomputable=False) for nd in diamond.nodes),
        diamond.edges,
    )
    twice = schedule_from_order(pinned, [0, 1, 0, 2, 3])
    with pytest.raises(ScheduleError, match="non-recomputable"):
        validate(pinned, twice)


def test_recompute_lowers_peak_on_a_chain() -> None:
    # training chain of 4: keeping everything peaks at the 4 forward values + b3.
    g = chain(4, training=True)
    assert keep_all_peak(g) == 5
    # recompute f0..f2 from scratch before each backward step: only two values live.
    order = [0, 1, 2, 3, 4]  # forward + b3
    order += [0, 1, 2, 5]  # b2 needs f2
    order += [0, 1, 6]  # b1 needs f1
    order += [0, 7]  # b0 needs f0
    sched = schedule_from_order(g, order)
    res = validate(g, sched)
    assert res.peak == 3  # b3 + f2 + b2
    assert res.cost == g.total_cost + 6
    assert res.recomputes == 6


def test_decode_rs_keep_all_equals_order() -> None:
    g = chain(5, training=True)
    n = g.n
    R = np.eye(n, dtype=bool)
    # keep each value exactly while it is still needed (S[t, i] = 1 for i < t <= last_use[i])
    t = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    S = (i < t) & (t <= np.asarray(g.last_use)[None, :])
    sched = schedule_from_rs(g, R, S)
    res = validate(g, sched)
    assert res.cost == g.total_cost
    assert res.peak == keep_all_peak(g)


def test_decode_rs_rejects_inconsistent_matrices() -> None:
    g = chain(3)
    R = np.eye(3, dtype=bool)
    S = np.zeros((3, 3), dtype=bool)  # node 1 reads node 0, which is neither kept nor recomputed
    with pytest.raises(ScheduleError, match="neither kept nor recomputed"):
        schedule_from_rs(g, R, S)
    with pytest.raises(ScheduleError, match="shape"):
        schedule_from_rs(g, R[:2], S)


@st.composite
def dags(draw: st.DrawFn) -> Graph:
    n = draw(st.integers(1, 12))
    nodes = [{"key": i, "cost": draw(st.integers(0, 5)), "mem": draw(st.integers(0, 9))} for i in range(n)]
    edges = {(i, j) for j in range(1, n) for i in draw(st.sets(st.integers(0, j - 1), max_size=3))}
    return Graph.build(nodes, sorted(edges))


@settings(max_examples=60, deadline=None)
@given(dags(), st.data())
def test_order_schedules_always_validate(g: Graph, data: st.DataObject) -> None:
    """Any topological compute order (with arbitrary extra recomputes) yields a valid plan."""
    base = list(range(g.n))
    res = validate(g, schedule_from_order(g, base))
    assert res.cost == pytest.approx(g.total_cost)
    # insert recomputes of a node's ancestors right before it is computed
    extra = data.draw(st.lists(st.integers(0, max(g.n - 1, 0)), max_size=4))
    seq: list[int] = []
    for v in base:
        if v in extra:
            anc = sorted(_ancestors(g, v))
            seq.extend(anc)
        seq.append(v)
    res2 = validate(g, schedule_from_order(g, seq))
    assert res2.cost >= res.cost
    assert int(res2.compute_counts.sum()) == len(seq)
    # computing v allocates its output while its inputs are resident: no peak is below that
    need = max(int(g.mem[v]) + sum(int(g.mem[p]) for p in g.preds[v]) for v in range(g.n))
    assert min(res.peak, res2.peak) >= need


def _ancestors(g: Graph, v: int) -> set[int]:
    out: set[int] = set()
    stack = list(g.preds[v])
    while stack:
        u = stack.pop()
        if u not in out:
            out.add(u)
            stack.extend(g.preds[u])
    return out
