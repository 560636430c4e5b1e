"""Save costs (``Node.save_cost``): what the forward spends only to hand a value to the
backward. The simulator charges them once, for the values resident when the first backward
node runs; the MILP, the LP rounding's costs and the min-cut sweep price them the same way,
so that a plan recomputes a value whose handing over costs more than its recomputation."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solvers import Graph, GraphError, Node, keep_all_peak, memory_lower_bound, simulate, validate
from solvers.formulation import encode, formulate
from solvers.io import graph_from_dict, graph_to_dict
from solvers.plan import cost_fingerprint
from solvers.schedule import Schedule, schedule_from_rs
from solvers.stages import complete_rs, rs_cost, s_from_schedule
from solvers.strategies import get_strategy
from tests.graphs import chain
from tests.unit.test_properties import training_graphs

LIMIT = 20.0


def with_saves(g: Graph, save: Callable[[Node], float]) -> Graph:
    """``g`` with each node's save cost ``save(node)``."""
    return Graph(tuple(dataclasses.replace(nd, save_cost=save(nd)) for nd in g.nodes), g.edges, name=g.name)


def chain3(save: float) -> Graph:
    """f0 -> f1 -> f2 -> b2 -> b1 -> b0 (b1 reads f1, b0 reads f0), unit costs and sizes,
    f1 handed to the backward at ``save``."""
    return with_saves(chain(3, training=True), lambda nd: save if nd.name == "f1" else 0.0)


def _ids(g: Graph) -> dict[str, int]:
    return {nd.name: nd.id for nd in g.nodes}


def keep_all(g: Graph) -> Schedule:
    i = _ids(g)
    order = ["f0", "f1", "f2", "b2", "b1", "b0"]
    return Schedule(tuple(("compute", i[k]) for k in order))


def recompute_f1(g: Graph) -> Schedule:
    i = _ids(g)
    steps = [("compute", i["f0"]), ("compute", i["f1"]), ("compute", i["f2"]), ("free", i["f1"])]
    steps += [("compute", i["b2"]), ("compute", i["f1"]), ("compute", i["b1"]), ("compute", i["b0"])]
    return Schedule(tuple(steps))


def test_the_simulator_charges_what_is_resident_when_the_backward_starts() -> None:
    g = chain3(save=2.5)
    kept = simulate(g, keep_all(g))
    assert kept.save_cost == 2.5 and kept.cost == 6 + 2.5
    again = simulate(g, recompute_f1(g))  # f1 freed before b2: recomputed, not handed over
    assert again.save_cost == 0.0 and again.cost == 7
    forward_only = chain(3)  # no backward: nothing is handed over
    assert simulate(forward_only, [("compute", k) for k in range(3)]).cost == 3


@pytest.mark.parametrize("strategy", ["ilp", "mincut", "cpsat", "lp-rounding", "auto"])
@pytest.mark.parametrize(("save", "best", "f1_runs"), [(2.5, 7.0, 2), (0.5, 6.5, 1)])
def test_the_solvers_recompute_a_value_whose_handing_over_costs_more(
    strategy: str, save: float, best: float, f1_runs: int
) -> None:
    if strategy == "cpsat":
        pytest.importorskip("ortools")
    g = chain3(save)
    res = get_strategy(strategy)(g, 100, time_limit=LIMIT)
    assert res.schedule is not None, res.status
    sim = validate(g, res.schedule, 100)
    assert sim.cost == pytest.approx(best)
    assert res.cost == pytest.approx(sim.cost)
    assert int(sim.compute_counts[_ids(g)["f1"]]) == f1_runs


def test_rs_cost_charges_as_the_simulator_does() -> None:
    g = chain3(save=2.5)
    for schedule, cost in ((keep_all(g), 8.5), (recompute_f1(g), 7.0)):
        S = s_from_schedule(g, schedule)
        assert S is not None
        R, S = complete_rs(g, S)
        assert rs_cost(g, R, S) == pytest.approx(cost) == simulate(g, schedule_from_rs(g, R, S)).cost


def test_save_costs_survive_the_graph_file_and_bad_ones_are_refused() -> None:
    g = chain3(save=2.5)
    back = graph_from_dict(graph_to_dict(g))
    assert back.save_cost.tolist() == g.save_cost.tolist()
    nodes = [{"key": 0, "cost": 1, "mem": 1, "save_cost": -1.0}]
    with pytest.raises(GraphError, match="save cost"):
        Graph.build(nodes, [])
    nodes = [{"key": 0, "cost": 1, "mem": 1, "backward": True, "save_cost": 1.0}]
    with pytest.raises(GraphError, match="backward node with a save cost"):
        Graph.build(nodes, [])


def test_plans_are_keyed_by_save_costs_too() -> None:
    assert cost_fingerprint(chain3(save=2.5)) != cost_fingerprint(chain3(save=0.5))
    plain = chain(3, training=True)  # no save costs: the fingerprint of plans made before them
    assert cost_fingerprint(plain) == hashlib.sha256(plain.cost.tobytes()).hexdigest()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    training_graphs(max_fwd=8), st.lists(st.floats(0.0, 20.0), min_size=8, max_size=8), st.floats(0.3, 1.0)
)
def test_the_milp_and_the_simulator_price_a_plan_alike(g: Graph, saves: list[float], frac: float) -> None:
    g = with_saves(g, lambda nd: 0.0 if nd.backward else saves[nd.id % len(saves)])
    low, ref = memory_lower_bound(g), keep_all_peak(g)
    budget = int(low + frac * (ref - low))
    res = get_strategy("peak-greedy")(g, budget, time_limit=5)
    if res.schedule is None:
        return
    S = s_from_schedule(g, res.schedule)
    if S is None:
        return
    R, S = complete_rs(g, S)
    model = formulate(g, budget)
    x = encode(g, model, R, S)
    assert x is not None
    simulated = simulate(g, schedule_from_rs(g, R, S)).cost
    assert float(model.cost @ x) * model.cost_unit == pytest.approx(simulated)
    assert rs_cost(g, R, S) == pytest.approx(simulated)
