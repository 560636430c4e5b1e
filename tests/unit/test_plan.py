"""Plan files: round trip, the public version-1 fields, checksums, stage matrices."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers import Graph, PlanError, SolveResult, Status, read_plan, validate, write_plan
from solvers.plan import PLAN_VERSION, document_checksum, plan_to_dict, stage_matrices
from solvers.schedule import Schedule, schedule_from_order, schedule_from_rs, simulate
from tests.graphs import chain

V1_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format": str,
    "version": int,
    "strategy": str,
    "status": str,
    "budget_bytes": int,
    "cost": float,
    "lower_bound": (float, type(None)),
    "peak_memory": int,
    "solve_seconds": float,
    "schedule": list,
}


def _result(graph: Graph, schedule: Schedule, budget: int, strategy: str = "test") -> SolveResult:
    sim = simulate(graph, schedule)
    return SolveResult(strategy, Status.FEASIBLE, budget, schedule, sim.cost, sim.peak, lower_bound=None)


def _recompute_schedule(graph: Graph) -> Schedule:
    """Training chain of 4: forward twice (f0..f3 recomputed for the backward half)."""
    n = graph.n // 2
    order = list(range(n)) + list(range(n - 1)) + list(range(n, 2 * n))
    # keep only what the second pass needs; schedule_from_order frees after last reads
    return schedule_from_order(graph, order)


def test_plan_round_trip_keeps_v1_fields(tmp_path: Path) -> None:
    g = chain(4, training=True)
    sched = _recompute_schedule(g)
    res = _result(g, sched, 10)
    path = write_plan(tmp_path / "p.json", plan_to_dict(g, res))
    doc = json.loads(path.read_text())
    for key, typ in V1_FIELDS.items():
        assert isinstance(doc[key], typ), key
    assert doc["format"] == "checkmate-plan" and doc["version"] == PLAN_VERSION == 1
    assert res.cost is not None
    assert doc["overhead"] == pytest.approx(res.cost / g.total_cost) and doc["overhead"] > 1
    assert doc["recomputes"] == 3
    recomputed = {d["name"] for d in doc["decisions"] if d["computes"] > 1}
    assert recomputed == {"f0", "f1", "f2"}
    back = read_plan(path, g)
    assert back.schedule.steps == sched.steps
    assert validate(g, back.schedule).cost == res.cost


def test_plan_uses_external_ids(tmp_path: Path) -> None:
    nodes = [{"key": k, "cost": 1, "mem": 1} for k in ("x", "y", "z")]
    g = Graph.build(nodes, [("x", "y"), ("y", "z")])
    res = _result(g, schedule_from_order(g, range(3)), 3)
    doc = json.loads(write_plan(tmp_path / "p.json", plan_to_dict(g, res)).read_text())
    assert [s[1] for s in doc["schedule"] if s[0] == "compute"] == ["x", "y", "z"]


def test_hand_edit_breaks_checksum(tmp_path: Path) -> None:
    g = chain(4, training=True)
    path = write_plan(tmp_path / "p.json", plan_to_dict(g, _result(g, _recompute_schedule(g), 10)))
    doc = json.loads(path.read_text())
    assert doc["checksum"] == document_checksum(doc)
    doc["cost"] = 1.0
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="checksum"):
        read_plan(path, g)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(version=PLAN_VERSION + 1), "version"),
        (lambda d: d.update(format="other"), "not a checkmate plan"),
        (lambda d: d.pop("schedule"), "lacks field"),
    ],
)
def test_rejects_bad_documents(tmp_path: Path, edit, match: str) -> None:  # type: ignore[no-untyped-def]
    g = chain(3)
    doc = plan_to_dict(g, _result(g, schedule_from_order(g, range(3)), 3))
    edit(doc)
    path = write_plan(tmp_path / "p.json", doc)  # re-sealed: only the edit itself is wrong
    with pytest.raises(PlanError, match=match):
        read_plan(path, g)


def test_rejects_truncated_and_foreign(tmp_path: Path) -> None:
    g = chain(4, training=True)
    path = write_plan(tmp_path / "p.json", plan_to_dict(g, _result(g, _recompute_schedule(g), 10)))
    text = path.read_text()
    (tmp_path / "t.json").write_text(text[: len(text) // 2])
    with pytest.raises(PlanError, match="truncated"):
        read_plan(tmp_path / "t.json", g)
    other = chain(4, training=True, mem=2)
    with pytest.raises(PlanError, match="another graph"):
        read_plan(path, other)


def test_stage_matrices_from_steps_match_rs() -> None:
    """Stages derived from the steps of a decoded (R, S) pair give back R exactly."""
    g = chain(4, training=True)
    n = g.n
    R = np.eye(n, dtype=bool)  # each stage computes its frontier node only
    S = np.tril(np.ones((n, n), dtype=bool), -1)  # keep everything computed so far
    sched = schedule_from_rs(g, R, S)
    R2, S2 = stage_matrices(g, Schedule(sched.steps))
    assert np.array_equal(R2, R)
    # S derived = residents before each stage's first compute: a subset of the kept ones
    assert not (S2 & ~S).any()
    half = n // 2
    assert S2[half, :half].all()  # the whole forward pass is held when the backward starts


def test_stage_matrices_show_recomputation() -> None:
    g = chain(4, training=True)
    R, S = stage_matrices(g, _recompute_schedule(g))
    assert R.shape == (g.n, g.n)
    assert int(R.sum()) == g.n + 3
    assert R.sum(axis=1).max() == 4  # one stage recomputes f0..f2, then computes b3
    assert np.array_equal(np.diag(R), np.ones(g.n, dtype=bool))
    assert S.dtype == bool and S.shape == R.shape


def test_stages_stored_and_read_back(tmp_path: Path) -> None:
    g = chain(3)
    n = g.n
    R = np.eye(n, dtype=bool)
    S = np.tril(np.ones((n, n), dtype=bool), -1)
    sched = schedule_from_rs(g, R, S)
    path = write_plan(tmp_path / "p.json", plan_to_dict(g, _result(g, sched, 10)))
    back = read_plan(path, g).schedule
    assert back.R is not None and back.S is not None
    assert np.array_equal(back.R, R) and np.array_equal(back.S, S)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 12),
    data=st.data(),
)
def test_round_trip_property(n: int, data: st.DataObject) -> None:
    """Any graph (float costs, odd sizes, skip edges) and schedule survive write + read
    with the checksum intact and the same simulated cost and peak."""
    costs = data.draw(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=n, max_size=n))
    mems = data.draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n))
    extra = data.draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=2 * n))
    edges = {(i, i + 1) for i in range(n - 1)} | {(min(a, b), max(a, b)) for a, b in extra if a != b}
    nodes = [{"key": f"n{i}", "name": f"op {i}", "cost": costs[i], "mem": mems[i]} for i in range(n)]
    g = Graph.build(nodes, [(f"n{a}", f"n{b}") for a, b in sorted(edges)])
    again = data.draw(st.lists(st.integers(0, n - 2), max_size=n))
    order = list(range(n))
    for j in again:  # recompute j (and its inputs' chain) right before a later reader
        order = order + list(range(j + 1))
    sched = schedule_from_order(g, order)
    sim = simulate(g, sched)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = write_plan(Path(tmp) / "p.json", plan_to_dict(g, _result(g, sched, sim.peak)))
        back = read_plan(path, g)
    assert back.schedule.steps == sched.steps
    sim2 = simulate(g, back.schedule)
    assert sim2.cost == sim.cost and sim2.peak == sim.peak == back.doc["peak_memory"]


def test_paging_plan_round_trips() -> None:
    """A POET plan (pageout/pagein steps) is written and read back, and replays valid."""
    from solvers import plan_to_dict, read_plan, solve, validate, write_plan
    from tests.graphs import chain

    g = chain(6, training=True, mem=1000)
    res = solve(g, 4000, "poet", time_limit=20)
    assert res.ok
    assert any(op == "pagein" for op, _ in res.schedule.steps)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = write_plan(f"{d}/p.json", plan_to_dict(g, res))
        back = read_plan(path, g)
    assert back.schedule.steps == res.schedule.steps
    assert validate(g, back.schedule, 4000).peak <= 4000


@given(n=st.integers(2, 12), data=st.data())
def test_checkpointed_matches_the_stage_matrices(n: int, data: st.DataObject) -> None:
    """The O(steps) 'checkpoint' flags equal the columns of S that hold a True."""
    from solvers.plan import checkpointed

    extra = data.draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=2 * n))
    edges = {(i, i + 1) for i in range(n - 1)} | {(min(a, b), max(a, b)) for a, b in extra if a != b}
    g = Graph.build(
        [{"key": f"n{i}", "cost": 1.0, "mem": 1} for i in range(n)],
        [(f"n{a}", f"n{b}") for a, b in sorted(edges)],
    )
    order = list(range(n))
    for j in data.draw(st.lists(st.integers(0, n - 2), max_size=n)):
        order = order + list(range(j + 1))
    sched = Schedule(schedule_from_order(g, order).steps)
    _, S = stage_matrices(g, sched)
    assert (checkpointed(g, sched) == S.any(axis=0)).all()
    chain_sched = Schedule(_recompute_schedule(chain(8, training=True)).steps)
    _, S = stage_matrices(chain(8, training=True), chain_sched)
    assert (checkpointed(chain(8, training=True), chain_sched) == S.any(axis=0)).all()


def test_plan_of_a_50k_chain_stays_sparse() -> None:
    """Writing a plan allocates O(nodes + steps): the (T, n) stage matrices of a 50,000-node
    chain would be 2.5 GB of booleans; the bound here is 100x below that."""
    import tracemalloc

    from solvers.api import solve

    g = chain(25_000, training=True)  # 50,000 nodes
    res = solve(g, 1.0, "checkpoint-all")
    tracemalloc.start()
    try:
        doc = plan_to_dict(g, res)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert doc["n_nodes"] == g.n and len(doc["schedule"]) == len(res.schedule.steps)
    assert peak < g.n * g.n // 100, f"{peak:,} bytes traced for a plan of {g.n:,} nodes"
