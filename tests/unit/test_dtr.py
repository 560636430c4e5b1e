"""DTR over the graph IR: valid schedules, the sqrt(N) chain result, the published figures."""

from __future__ import annotations

import math

import numpy as np
import pytest

from solvers import Graph, Status, keep_all_peak, memory_lower_bound, solve, validate
from solvers.strategies import get_strategy
from solvers.strategies.dtr import HEURISTICS, DTRSimulator, run_dtr
from tests.graphs import chain, public_graph

VARIANTS = ("dtr", "dtr-full", "dtr-eq", "dtr-local", "dtr-lru", "dtr-size")


def training_graph(
    n_fwd: int,
    fwd_edges: list[tuple[int, int]],
    costs: list[float],
    mems: list[int],
    non_recomputable: tuple[int, ...] = (),
) -> Graph:
    """A forward DAG and its mirrored backward part, as in the Checkmate graphs: the
    gradient node of f_i reads f_i, f_i's inputs and the previous gradient node.

    ``costs`` and ``mems`` have 2 * n_fwd entries (forward nodes, then gradient nodes in
    the order they run: the gradient of f_{n-1} first)."""
    nodes = [
        {
            "key": k,
            "cost": costs[k],
            "mem": mems[k],
            "backward": k >= n_fwd,
            "recomputable": k not in non_recomputable,
        }
        for k in range(2 * n_fwd)
    ]
    edges = set(fwd_edges)
    for j in range(n_fwd):
        i, g = n_fwd - 1 - j, n_fwd + j
        edges.add((i, g))
        edges.update((u, g) for u, v in fwd_edges if v == i)
        if j:
            edges.add((g - 1, g))
    return Graph.build(nodes, sorted(edges), name="random-train")


def random_training_graph(seed: int, n_fwd: int = 12) -> Graph:
    """:func:`training_graph` with random edges (each node reads 1-2 of the 4 before it)."""
    rng = np.random.default_rng(seed)
    fwd_edges: set[tuple[int, int]] = set()
    for v in range(1, n_fwd):
        lo = max(0, v - 4)
        k = min(v - lo, int(rng.integers(1, 3)))
        fwd_edges.update((int(u), v) for u in rng.choice(np.arange(lo, v), size=k, replace=False))
    costs = rng.integers(1, 10, size=2 * n_fwd).astype(float).tolist()
    mems = rng.integers(1, 20, size=2 * n_fwd).tolist()
    return training_graph(n_fwd, sorted(fwd_edges), costs, mems)


@pytest.mark.parametrize("banish", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_every_heuristic_gives_a_valid_schedule_or_says_why(seed: int, banish: bool) -> None:
    g = random_training_graph(seed)
    ref, low = keep_all_peak(g), memory_lower_bound(g)
    for frac in (1.0, 0.7, 0.4, 0.1):
        budget = int(low + frac * (ref - low))
        for h in HEURISTICS:
            run = DTRSimulator(g, budget, h, banish=banish).run()
            if h == "eq" and frac >= 0.4:
                assert run.ok, run.message  # these graphs leave h_eq room to work
            if not run.ok:
                assert run.message and run.schedule is None
                continue
            assert run.schedule is not None
            sim = validate(g, run.schedule, budget)
            assert sim.cost == pytest.approx(run.cost)
            assert sim.cost >= g.total_cost
            if frac == 1.0:
                assert run.recomputes == 0  # nothing is evicted when everything fits


@pytest.mark.parametrize("n", [64, 256])
@pytest.mark.parametrize("heuristic", ["eq", "dtr"])
def test_chain_trains_in_sqrt_n_memory_with_linear_ops(n: int, heuristic: str) -> None:
    # Kirisame et al., Thm. 3.1: an N-layer chain in O(sqrt N) memory with O(N) ops
    g = chain(n, training=True)
    budget = round(2 * math.sqrt(n))
    run = run_dtr(g, budget, heuristic)
    assert run.ok, run.message
    assert run.schedule is not None
    sim = validate(g, run.schedule, budget)
    ops = int(sim.compute_counts.sum())
    assert 2 * n < ops <= 4 * n


def test_published_mobilenet_figure_at_0_6() -> None:
    # Published DTR (h_eq) simulation: 1.011x the no-recompute cost at 0.6 of keep-all peak
    g = public_graph("MobileNet_b512_224x224.json")
    res = solve(g, 0.6, "dtr", heuristic="eq")
    assert res.status == Status.FEASIBLE and res.cost is not None
    assert res.cost / g.total_cost == pytest.approx(1.011, rel=0.02)


def test_unet_fits_down_to_0_4_and_fails_at_0_3_as_published() -> None:
    g = public_graph("vgg_unet_b32_416x608.json")
    ref = keep_all_peak(g)
    costs = []
    for frac in (0.8, 0.6, 0.5, 0.4):
        res = get_strategy("dtr")(g, int(frac * ref))
        assert res.ok, res.info
        assert res.cost is not None
        costs.append(res.cost)
    assert costs == sorted(costs)  # less memory, more recompute
    assert get_strategy("dtr")(g, int(0.3 * ref)).status == Status.NO_SOLUTION


def test_registered_variants_run_through_the_api() -> None:
    g = public_graph("ResNet50_b256_224x224.json")
    for name in VARIANTS:
        res = solve(g, 0.5, name, time_limit=30)
        assert res.ok, (name, res.info)
        assert res.peak is not None and res.peak <= 0.5 * keep_all_peak(g)


def test_thrash_limit_and_too_small_budget_stop_with_a_reason() -> None:
    g = chain(64, training=True)
    thrash = get_strategy("dtr-lru")(g, 6, thrash_factor=2.0)
    assert thrash.status == Status.NO_SOLUTION and "thrashing" in thrash.info["message"]
    stuck = get_strategy("dtr")(g, 2)
    assert stuck.status == Status.NO_SOLUTION and "raise the budget" in stuck.info["message"]
    with pytest.raises(ValueError, match="heuristic"):
        run_dtr(g, 10, "nope")


def test_non_recomputable_values_are_never_recomputed() -> None:
    base = chain(32, training=True)
    nodes = [
        {
            "key": nd.id,
            "cost": nd.cost,
            "mem": nd.mem,
            "backward": nd.backward,
            "recomputable": nd.id % 7 != 3,
        }
        for nd in base.nodes
    ]
    g = Graph.build(nodes, base.edges)
    for h in HEURISTICS:
        run = run_dtr(g, 14, h)
        assert run.ok, (h, run.message)
        assert run.schedule is not None
        counts = validate(g, run.schedule, 14).compute_counts
        assert (counts[~g.recomputable_mask] == 1).all()
        assert counts.sum() > g.n  # the budget forced recomputation
