"""Repeated blocks (solvers.repeats) and peak-greedy's tie_layers option."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from solvers import Graph, save_graph
from solvers.api import resolve_budget
from solvers.repeats import RepeatRun, edge_classes, find_repeats
from solvers.schedule import validate
from solvers.strategies.greedy import peak_greedy
from tests.graphs import public_graph
from tests.unit.test_dtr import training_graph

#: one layer: a reads the previous output, b and c read a, d reads b, c and the input
LAYER_MEM = (4, 2, 3, 4)
LAYER_COST = (2.0, 1.0, 3.0, 1.0)


def layered(
    k: int, *, mem_of: dict[int, int] | None = None, cost_of: dict[int, float] | None = None
) -> Graph:
    """A stem, k identical 4-node residual layers and a head, with the mirrored backward."""
    n_fwd = 2 + 4 * k
    edges: list[tuple[int, int]] = []
    for j in range(k):
        x, a = 4 * j, 1 + 4 * j  # x: the layer's input (the stem or the previous d)
        edges += [(x, a), (a, a + 1), (a, a + 2), (a + 1, a + 3), (a + 2, a + 3), (x, a + 3)]
    edges.append((n_fwd - 2, n_fwd - 1))
    fwd_mem = [7, *LAYER_MEM * k, 1]
    fwd_cost = [1.0, *LAYER_COST * k, 1.0]
    for i, m in (mem_of or {}).items():
        fwd_mem[i] = m
    for i, c in (cost_of or {}).items():
        fwd_cost[i] = c
    mems = fwd_mem + fwd_mem[::-1]  # gradient of f_i as large as f_i
    costs = fwd_cost + [2 * c for c in fwd_cost[::-1]]
    return training_graph(n_fwd, edges, costs, mems)


def copies_ok(graph: Graph, run: RepeatRun) -> bool:
    """The definition, checked independently: same op/mem/flags/cost node by node, same
    internal edges after the offset, same number of edges entering each offset."""
    edges = set(graph.edges)

    def view(s: int) -> tuple[object, ...]:
        stop = s + run.length
        inner = {(u - s, v - s) for u, v in edges if s <= u < stop and s <= v < stop}
        enter = [sum(1 for u in graph.preds[v] if u < s) for v in range(s, stop)]
        nodes = [(nd.op, nd.mem, nd.backward, nd.recomputable) for nd in graph.nodes[s:stop]]
        return (frozenset(inner), tuple(enter), tuple(nodes))

    first = view(run.starts[0])
    return all(view(s) == first for s in run.starts[1:])


@pytest.mark.parametrize("k", [2, 3, 6])
def test_identical_layers_are_k_copies_forward_and_backward(k: int) -> None:
    g = layered(k)
    rep = find_repeats(g)
    fwd = [r for r in rep.runs if not r.backward]
    bwd = [r for r in rep.runs if r.backward]
    assert fwd and fwd[0].copies == k and fwd[0].length == 4
    assert fwd[0].starts == tuple(1 + 4 * j for j in range(k))
    assert bwd and bwd[0].copies == k and bwd[0].length == 4
    assert all(copies_ok(g, r) for r in rep.runs)
    # the mapping: node -> (run, copy, offset)
    r = rep.runs.index(fwd[0])
    assert rep.locate(1 + 4 * (k - 1) + 2) == (r, k - 1, 2)
    assert fwd[0].locate(0) is None and rep.locate(0) is None


def test_a_layer_that_differs_breaks_the_run() -> None:
    odd = 1 + 4 * 3 + 1  # b of layer 3 of 6
    g = layered(6, mem_of={odd: 5})
    rep = find_repeats(g)
    assert rep.locate(odd) is None
    fwd = sorted((r for r in rep.runs if not r.backward), key=lambda r: r.starts[0])
    assert [(r.starts[0], r.copies) for r in fwd] == [(1, 3), (17, 2)]
    assert all(copies_ok(g, r) for r in rep.runs)


def test_costs_compared_within_the_tolerance() -> None:
    c = 1 + 4 * 2  # a of layer 2 of 4
    near = layered(4, cost_of={c: LAYER_COST[0] * (1 + 1e-9)})
    assert max(r.copies for r in find_repeats(near).runs if not r.backward) == 4
    far = layered(4, cost_of={c: LAYER_COST[0] * 1.01})
    assert max(r.copies for r in find_repeats(far).runs if not r.backward) < 4
    assert max(r.copies for r in find_repeats(far, cost_rtol=None).runs if not r.backward) == 4


def test_random_graphs_report_only_true_copies() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(8, 60))
        nodes = [{"key": i, "cost": 1.0, "mem": int(rng.integers(1, 3))} for i in range(n)]
        edges = {(int(u), v) for v in range(1, n) for u in rng.choice(v, size=min(v, 2), replace=False)}
        g = Graph.build(nodes, sorted(edges))
        rep = find_repeats(g)
        spans = sorted(r.span for r in rep.runs)
        assert all(a[1] <= b[0] for a, b in pairwise(spans))  # disjoint
        assert all(r.copies >= 2 and copies_ok(g, r) for r in rep.runs)


def test_edge_classes_tie_each_layer_edge_to_its_copies() -> None:
    k = 4
    g = layered(k)
    cls = edge_classes(g, find_repeats(g))
    e = g.edge_array
    index = {(int(u), int(v)): i for i, (u, v) in enumerate(e)}
    for u, v in [(1, 2), (1, 3), (2, 4), (3, 4)]:  # edges inside layer 0
        images = [index[(u + 4 * j, v + 4 * j)] for j in range(k)]
        assert len({int(cls[i]) for i in images}) == 1
    assert cls[index[(0, 1)]] == index[(0, 1)]  # from the stem: not in a layer


@pytest.mark.parametrize("frac", [0.9, 0.7, 0.5])
def test_tie_layers_schedules_validate_within_the_budget(frac: float) -> None:
    g = layered(6)
    budget = resolve_budget(g, frac)[0]
    res = peak_greedy(g, budget, tie_layers=True)
    assert res.ok and res.schedule is not None
    validate(g, res.schedule, budget)
    assert "same drop points in every repeated layer (approximation)" in res.info["restrictions"]
    assert "6 x 4" in res.info["repeats"]
    plain = peak_greedy(g, budget)
    assert "restrictions" not in plain.info


def test_public_resnet50_blocks_and_tied_schedule() -> None:
    g = public_graph("ResNet50_b256_224x224.json")
    rep = find_repeats(g, cost_rtol=None)  # profiled costs differ from block to block
    fwd = [r for r in rep.runs if not r.backward]
    assert max(r.copies for r in fwd) >= 3
    assert all(copies_ok(g, r) for r in rep.runs)
    budget = resolve_budget(g, 0.7)[0]
    res = peak_greedy(g, budget, tie_layers=True)
    assert res.ok and res.schedule is not None
    validate(g, res.schedule, budget)


def test_cli_show_names_the_repeated_blocks(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from checkmate.cli import cli

    graph_file, plan = tmp_path / "layers.json", tmp_path / "plan.json"
    save_graph(layered(5), graph_file)
    runner = CliRunner()
    solved = runner.invoke(
        cli, ["solve", str(graph_file), "-b", "0.8", "-s", "peak-greedy", "-o", str(plan), "-q"]
    )
    assert solved.exit_code == 0, solved.output
    res = runner.invoke(cli, ["show", str(plan), "--graph", str(graph_file)])
    assert res.exit_code == 0, res.output
    assert "repeats" in res.stdout and "5 x 4 forward nodes at 1..20" in res.stdout
