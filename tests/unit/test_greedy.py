"""peak-greedy and the segment helpers it shares with Chen's baselines."""

from __future__ import annotations

import numpy as np
import pytest

from solvers import Graph, Status, keep_all_peak, schedule_from_order, validate
from solvers.strategies import get_strategy
from solvers.strategies._segments import articulation_points, forced_keep, sticky_values
from tests.graphs import public_graph
from tests.unit._bruteforce import optimal_cost
from tests.unit.test_dtr import training_graph


def _layers_with_a_shared_mask(layers: int) -> Graph:
    """A transformer-like forward: node 0 (a 1-byte mask) is read by every layer's second
    node; each layer is two 10-byte nodes; gradients mirror the forward."""
    n_fwd = 1 + 2 * layers
    edges = [(0, 1)]
    for k in range(layers):
        a, b = 1 + 2 * k, 2 + 2 * k
        edges += [(a, b), (0, b)]
        if k:
            edges.append((a - 1, a))
    mems = [1] + [10] * (n_fwd - 1) + [10] * n_fwd
    return training_graph(n_fwd, edges, [1.0] * (2 * n_fwd), mems)


def test_a_small_value_every_layer_reads_does_not_hide_the_layer_boundaries() -> None:
    g = _layers_with_a_shared_mask(4)
    fwd = ~g.backward_mask
    assert not {2, 4, 6} & set(articulation_points(g).tolist())  # the mask's edges jump over them
    sticky = sticky_values(g)
    extra = sticky & ~forced_keep(g) & fwd
    assert extra.tolist() == [True] + [False] * (g.n - 1)  # the mask, and no layer value
    # with the mask resident, each layer's output separates the graph again
    assert {2, 4, 6}.issubset(articulation_points(g, sticky).tolist())


def test_cheap_bytes_are_dropped_before_expensive_ones() -> None:
    # forward chain a -> b -> c -> d; c is large and costly: at a budget that forces a
    # recompute, the optimum (brute force: 58) recomputes a cheap node, never c (107)
    costs = [1.0, 1.0, 50.0, 1.0] + [1.0] * 4
    mems = [4, 8, 8, 4] + [4] * 4
    g = training_graph(4, [(0, 1), (1, 2), (2, 3)], costs, mems)
    budget = keep_all_peak(g) - 2
    res = get_strategy("peak-greedy")(g, budget)
    assert res.status == Status.FEASIBLE
    sim = validate(g, res.schedule, budget)
    assert sim.compute_counts[2] == 1 and sim.recomputes >= 1
    assert res.cost == pytest.approx(optimal_cost(g, budget))


@pytest.mark.parametrize("name", ["MobileNet_b512_224x224.json", "ResNet50_b256_224x224.json"])
def test_beats_chen_and_dtr_on_public_graphs(name: str) -> None:
    g = public_graph(name)
    budget = int(0.6 * keep_all_peak(g))
    res = get_strategy("peak-greedy")(g, budget, time_limit=10)
    assert res.status == Status.FEASIBLE
    validate(g, res.schedule, budget)
    for other in ("chen-greedy", "dtr"):
        ref = get_strategy(other)(g, budget, time_limit=10)
        assert ref.cost is None or res.cost <= ref.cost, other


def test_reports_its_least_peak_when_nothing_fits() -> None:
    g = _layers_with_a_shared_mask(3)
    res = get_strategy("peak-greedy")(g, 25)
    assert res.status == Status.NO_SOLUTION and res.schedule is not None
    assert res.peak is not None and res.peak > 25 and "over the budget" in res.info["message"]
    assert np.all(validate(g, res.schedule).compute_counts >= 1)


@pytest.mark.parametrize("seed", range(5))
def test_a_kept_set_policy_recomputes_exactly_the_dropped_values_the_backward_reads(seed: int) -> None:
    from solvers.strategies._segments import checkpoint_sequence, drop_sequence, last_forward_reader
    from tests.unit.test_dtr import random_training_graph

    g = random_training_graph(seed)
    assert drop_sequence(g, np.zeros(len(g.edges), dtype=bool))[0] == list(range(g.n))  # keep-all
    rng = np.random.default_rng(seed)
    kept = [int(v) for v in np.flatnonzero(~g.backward_mask) if rng.random() < 0.4]
    sim = validate(g, schedule_from_order(g, checkpoint_sequence(g, kept)))
    dropped = ~forced_keep(g) & ~g.backward_mask & (last_forward_reader(g) >= 0)
    dropped[kept] = False
    dropped &= np.array([any(g.nodes[s].backward for s in g.succs[v]) for v in range(g.n)])
    assert dropped.any()
    assert (sim.compute_counts[~dropped] == 1).all()  # kept values and the backward run once
    assert (sim.compute_counts[dropped] >= 2).all()  # recomputed for the backward
