"""Costs as the solvers' models see them: normalised, and within a span they can resolve.

The exact models never take graph costs as they are. The MILP (``ilp``, ``lp-rounding``,
``poet``) divides every cost by :func:`cost_unit`, the mean cost, so that its objective
coefficients are near 1 whatever the unit (seconds, microseconds, 1e30 abstract units);
CP-SAT maps the total cost to a fixed number of integer units. A uniform scaling of all
costs therefore gives the same model and the same plan (tested with costs x 2**100).

What a scale factor cannot fix is the *span* of the costs: HiGHS works to absolute
tolerances near 1e-7 on coefficients near 1, and CP-SAT rounds each cost to an integer
unit, so a node that costs 1e30 next to nodes that cost 1 makes the cheap nodes invisible
(their scaled costs are ~1e-27): the solver then recomputes them at will and still calls
its plan optimal. Decision: the exact models reject a graph whose largest positive cost
exceeds its smallest positive cost by more than :data:`MAX_COST_SPAN` (1e9) with a
:class:`~solvers.errors.GraphError` that names both nodes. Zero costs are allowed and not
part of the span. The public benchmark graphs span at most 1.35e6 (fcn_8_vgg), traced
graphs far less (their costs have a floor). The heuristics take any finite costs, and
``auto`` records the exact models' error and keeps the heuristics' best plan.
"""

from __future__ import annotations

import numpy as np

from solvers.errors import GraphError
from solvers.graph import Graph

__all__ = ["MAX_COST_SPAN", "check_cost_span", "cost_unit"]

#: Largest ratio of the largest to the smallest positive node cost the exact models take.
MAX_COST_SPAN = 1e9


def check_cost_span(graph: Graph, model: str) -> None:
    """Raise GraphError when ``graph``'s positive costs span more than :data:`MAX_COST_SPAN`.

    Args:
        graph: the graph to be modelled.
        model: the model's name for the message (``"the MILP"``, ``"CP-SAT"``).
    """
    cost = graph.cost
    pos = np.flatnonzero(cost > 0)
    if len(pos) < 2:
        return
    hi = int(pos[np.argmax(cost[pos])])
    lo = int(pos[np.argmin(cost[pos])])
    span = float(cost[hi] / cost[lo])
    if span > MAX_COST_SPAN:
        big, small = graph.nodes[hi], graph.nodes[lo]
        raise GraphError(
            f"node {big.ext!r} ({big.name!r}) costs {big.cost:.6g}, {span:.3g} times node "
            f"{small.ext!r} ({small.name!r}) at {small.cost:.6g}: {model} resolves positive costs "
            f"within a ratio of {MAX_COST_SPAN:.0e} only; use a heuristic strategy (auto falls "
            "back to them), or give such costs on a common scale (0 for negligible ops)"
        )


def cost_unit(graph: Graph, model: str) -> float:
    """The graph cost one unit of a MILP objective stands for: the mean node cost.

    Checks the span first (:func:`check_cost_span`); 1.0 for a graph of zero costs.
    """
    check_cost_span(graph, model)
    total = graph.total_cost
    return total / graph.n if total > 0 else 1.0
