"""The checkpointing baselines: hand-derived answers on chains, and the public graphs."""

from __future__ import annotations

from math import comb

import pytest

from solvers import Graph, Schedule, SolveResult, Status, keep_all_peak, validate
from solvers.strategies import get_strategy
from solvers.strategies._segments import articulation_points, checkpoint_sequence
from solvers.strategies.baselines import chen_greedy_kept, revolve_table
from tests.graphs import chain, public_graph

BASELINES = ("checkpoint-all", "checkpoint-last-node", "chen-sqrtn", "chen-greedy", "griewank")


def _griewank_steps(steps: int, states: int) -> int:
    """Griewank & Walther's minimal forward steps to reverse ``steps`` steps with
    ``states`` stored states: r*l - C(s+r, s+1), r least with C(s+r, s) >= l."""
    r = 0
    while comb(states + r, states) < steps:
        r += 1
    return r * steps - comb(states + r, states + 1)


def test_revolve_table_matches_the_binomial_closed_form() -> None:
    T, choice = revolve_table(40, 6)
    for ln in range(1, 41):
        for s in range(7):
            assert T[ln, s] == _griewank_steps(ln + 1, s + 1), (ln, s)
            assert 1 <= choice[ln, s] <= ln


def test_checkpoint_all_is_optimal_at_keep_all_peak_and_refuses_less() -> None:
    g = chain(10, training=True)
    ref = keep_all_peak(g)
    res = get_strategy("checkpoint-all")(g, ref)
    assert res.status == Status.OPTIMAL
    assert res.cost == g.total_cost == res.lower_bound
    assert validate(g, _sched(res), ref).peak == ref
    low = get_strategy("checkpoint-all")(g, ref - 1)
    assert low.status == Status.NO_SOLUTION and low.schedule is not None
    assert "over the budget" in low.info["message"]


def test_chen_sqrtn_on_a_16_chain_keeps_every_fourth_and_recomputes_the_rest_once() -> None:
    # f3, f7, f11, f15 kept; the 12 other forward values are recomputed once each.
    # Peak (hand count): during b14, f3 f7 f11 + recomputed f12 f13 f14 + b15 + b14 = 8.
    g = chain(16, training=True)
    res = get_strategy("chen-sqrtn")(g, 8)
    assert res.status == Status.FEASIBLE
    sim = validate(g, _sched(res), 8)
    assert sim.cost == 32 + 12
    assert sim.peak == 8
    assert sorted(i for i in range(16) if sim.compute_counts[i] == 1) == [3, 7, 11, 15]
    assert get_strategy("chen-sqrtn")(g, 7).status == Status.NO_SOLUTION


def test_checkpoint_last_node_recomputes_the_prefix_for_every_gradient() -> None:
    # b_i (i < n-1) keeps only b_{i+1}: it recomputes f_0..f_i, i+1 computes.
    n = 8
    g = chain(n, training=True)
    res = get_strategy("checkpoint-last-node")(g, 3)
    assert res.status == Status.FEASIBLE
    sim = validate(g, _sched(res), 3)
    assert sim.cost == 2 * n + n * (n - 1) // 2
    assert sim.peak == 3


@pytest.mark.parametrize("budget", [4, 5, 6, 8, 10, 17])
def test_griewank_on_a_chain_does_the_binomial_number_of_forward_steps(budget: int) -> None:
    n = 16
    g = chain(n, training=True)
    res = get_strategy("griewank")(g, budget)
    assert res.status == Status.FEASIBLE
    sim = validate(g, _sched(res), budget)
    forward_steps = int(sim.compute_counts[:n].sum())
    T, _ = revolve_table(n, n)
    assert forward_steps == T[n, res.info["slots"]]
    # more memory never costs more
    if budget > 4:
        assert sim.cost <= _cost(get_strategy("griewank")(g, budget - 1))


def test_griewank_refuses_graphs_whose_forward_part_is_not_a_chain(diamond: Graph) -> None:
    res = get_strategy("griewank")(_with_backward(diamond), 10**9)
    assert res.status == Status.NO_SOLUTION and res.schedule is None
    assert "chain" in res.info["message"]


def test_chen_greedy_sweeps_down_to_keep_all_and_fits_tighter_budgets() -> None:
    g = chain(16, training=True)
    assert chen_greedy_kept([1, 1, 1, 1, 1], 1.5) == [1, 3]
    full = get_strategy("chen-greedy")(g, keep_all_peak(g))
    assert full.cost == g.total_cost
    tight = get_strategy("chen-greedy")(g, 8)
    assert tight.status == Status.FEASIBLE
    assert g.total_cost < validate(g, _sched(tight), 8).cost <= 44


def test_articulation_points_are_the_nodes_no_forward_edge_jumps_over() -> None:
    # f0 -> f1 -> f2 -> f3 with a skip f0 -> f2: f1 is jumped over
    nodes = [{"key": i, "cost": 1, "mem": 1} for i in range(4)]
    g = Graph.build(nodes, [(0, 1), (1, 2), (2, 3), (0, 2)])
    assert articulation_points(g).tolist() == [0, 2, 3]


def test_non_recomputable_nodes_are_kept_and_run_once() -> None:
    base = chain(12, training=True)
    nodes = [
        {
            "key": nd.id,
            "name": nd.name,
            "cost": nd.cost,
            "mem": nd.mem,
            "backward": nd.backward,
            "recomputable": nd.id not in (2, 5),
        }
        for nd in base.nodes
    ]
    g = Graph.build(nodes, base.edges)
    for name in BASELINES:
        res = get_strategy(name)(g, keep_all_peak(g))
        assert res.schedule is not None, name
        sim = validate(g, _sched(res))  # raises if a non-recomputable node runs twice
        assert sim.compute_counts[2] == sim.compute_counts[5] == 1, name
    assert checkpoint_sequence(g, []).count(5) == 1


@pytest.mark.parametrize(
    ("name", "frac"),
    [
        ("VGG16_b256_224x224.json", 0.9),
        ("MobileNet_b512_224x224.json", 0.5),
        ("ResNet50_b256_224x224.json", 0.7),
    ],
)
def test_baselines_on_public_graphs_give_valid_schedules(name: str, frac: float) -> None:
    g = public_graph(name)
    budget = int(frac * keep_all_peak(g))
    fitted = 0
    for strat in BASELINES:
        res = get_strategy(strat)(g, budget)
        if res.schedule is None:
            assert strat == "griewank" and "chain" in res.info["message"]
            continue
        sim = validate(g, _sched(res))
        assert sim.cost == pytest.approx(res.cost) and sim.peak == res.peak
        assert _cost(res) >= g.total_cost
        if res.ok:
            fitted += 1
            assert sim.peak <= budget
    # Chen's greedy segmentation fits all three (it sweeps its threshold)
    assert get_strategy("chen-greedy")(g, budget).ok
    assert fitted >= 2


def test_forward_only_graph_gets_the_keep_all_order() -> None:
    g = public_graph("random_layered_n100.json")
    ref = keep_all_peak(g)
    res = get_strategy("chen-greedy")(g, ref)
    assert res.ok and res.cost == g.total_cost
    assert "no backward" in res.info["note"]


def _with_backward(g: Graph) -> Graph:
    """``g`` plus one backward node per node reading it and the previous backward node."""
    nodes = [{"key": nd.id, "cost": nd.cost, "mem": nd.mem} for nd in g.nodes]
    edges = list(g.edges)
    for j in range(g.n):
        i = g.n - 1 - j
        nodes.append({"key": g.n + j, "cost": 1, "mem": 1, "backward": True})
        edges.append((i, g.n + j))
        if j:
            edges.append((g.n + j - 1, g.n + j))
    return Graph.build(nodes, edges)


def _sched(res: SolveResult) -> Schedule:
    assert res.schedule is not None, res.info
    return res.schedule


def _cost(res: SolveResult) -> float:
    assert res.cost is not None, res.info
    return res.cost
