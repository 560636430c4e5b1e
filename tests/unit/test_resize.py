"""A schedule carried over to the same graph at other sizes (solvers.resize)."""

from __future__ import annotations

from typing import Any

from solvers.graph import Graph
from solvers.resize import stretch, structure, transfer, transfer_and_check
from solvers.schedule import COMPUTE, FREE, schedule_from_order, simulate


def _graph(
    sizes: dict[str, int], workspace: dict[str, int] | None = None, order: list[str] | None = None
) -> Graph:
    """a -> b -> c -> d with a skip a -> d; ``workspace`` adds a scratch node before an op."""
    nodes: list[dict[str, Any]] = [
        {"key": k, "name": k, "cost": 1.0, "mem": m, "op": "x"} for k, m in sizes.items()
    ]
    edges = [("a", "b"), ("b", "c"), ("c", "d"), ("a", "d")]
    for op, m in (workspace or {}).items():
        w = f"{op}.workspace"
        nodes.append({"key": w, "name": w, "cost": 0.0, "mem": m, "op": "workspace"})
        preds = [u for u, v in edges if v == op]
        edges += [(u, w) for u in preds] + [(w, op)]
    return Graph.build(nodes, edges, order=order)


def test_a_schedule_moves_to_other_sizes_and_is_resimulated() -> None:
    small = _graph({"a": 1, "b": 2, "c": 3, "d": 4})
    large = _graph({"a": 10, "b": 20, "c": 30, "d": 40})
    sched = schedule_from_order(small, range(small.n))
    assert structure(small) == structure(large)
    got = transfer_and_check(small, sched, large, None)
    assert got is not None
    _, sim = got
    assert sim.peak == simulate(large, schedule_from_order(large, range(large.n))).peak
    # the same plan does not fit a budget below its peak at the larger sizes
    assert transfer_and_check(small, sched, large, sim.peak - 1) is None
    assert transfer_and_check(small, sched, large, sim.peak) is not None


def test_scratch_nodes_come_and_go_with_the_sizes() -> None:
    plain = _graph({"a": 1, "b": 2, "c": 3, "d": 4})
    scratch = _graph({"a": 1, "b": 2, "c": 3, "d": 4}, workspace={"c": 100})
    sched = schedule_from_order(plain, range(plain.n))
    moved = transfer(plain, sched, scratch)
    assert moved is not None
    w, c = scratch.index_of("c.workspace"), scratch.index_of("c")
    i = moved.steps.index((COMPUTE, w))
    assert moved.steps[i + 1 : i + 3] == ((COMPUTE, c), (FREE, w))
    assert simulate(scratch, moved).peak >= 100
    back = transfer(scratch, moved, plain)
    assert back is not None and simulate(plain, back).peak == simulate(plain, sched).peak


def test_another_graph_is_refused() -> None:
    g = _graph({"a": 1, "b": 2, "c": 3, "d": 4})
    other = Graph.build(
        [{"key": k, "name": k, "cost": 1.0, "mem": 1, "op": "x"} for k in "abcd"],
        [("a", "b"), ("b", "c"), ("c", "d")],
    )
    assert transfer(g, schedule_from_order(g, range(g.n)), other) is None


def test_node_order_does_not_matter() -> None:
    g = _graph({"a": 1, "b": 2, "c": 3, "d": 4})
    h = Graph.build(
        [{"key": k, "name": k, "cost": 1.0, "mem": m, "op": "x"} for k, m in zip("abcd", (5, 6, 7, 8))]
        + [{"key": "e", "name": "e", "cost": 1.0, "mem": 1, "op": "x"}],
        [("a", "b"), ("b", "c"), ("c", "d"), ("a", "d"), ("a", "e")],
    )
    assert structure(g) != structure(h)  # an extra node: another graph
    nodes = [{"key": k, "name": k, "cost": 1.0, "mem": 1, "op": "x"} for k in "abcd"]
    edges = [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")]
    one = Graph.build(nodes, edges, order=["a", "b", "c", "d"])
    two = Graph.build(nodes, edges, order=["a", "c", "b", "d"])
    assert structure(one) == structure(two)
    moved = transfer(one, schedule_from_order(one, range(one.n)), two)
    assert moved is not None
    assert [two.nodes[i].ext for i in moved.computes] == ["a", "b", "c", "d"]
    assert simulate(two, moved).peak == simulate(one, schedule_from_order(one, range(one.n))).peak


def test_stretch_extrapolates_each_node_by_its_own_growth() -> None:
    # a: constant (a weight's gradient), b, c: linear in the size, d: quadratic
    old = _graph({"a": 100, "b": 10, "c": 20, "d": 100})
    new = _graph({"a": 100, "b": 20, "c": 40, "d": 400})
    big = stretch(old, new, 2.0)
    assert big is not None
    mem = {node.ext: node.mem for node in big.nodes}
    assert mem == {"a": 100, "b": 40, "c": 80, "d": 1600}
    assert big.edges == new.edges and list(big.cost) == list(new.cost)
    # a plan of the stretched graph carried back to the real sizes fits at least as well
    sched = schedule_from_order(big, range(big.n))
    got = transfer_and_check(big, sched, new, simulate(big, sched).peak)
    assert got is not None
    assert stretch(new, old) is None  # nothing grew
