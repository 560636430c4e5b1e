"""A bound on what a plan holds at its forward/backward boundary, beside its peak.

A step split into several graphs (graph breaks, DDP's gradient buckets) runs their
forwards in order and their backwards in reverse: while a later graph runs, an earlier one
holds what its forward handed to its backward. The step then fits a budget ``B`` only if
each graph's own peak fits beside what the others hold *and* its boundary hold leaves room
for the graphs that run between its forward and its backward. A peak budget alone is blind
to the second: two plans of equal peak can hold very different amounts at the boundary.

The bound is planned by every strategy unchanged, through the graph: a zero-cost
*ballast* node of about ``peak - boundary`` bytes is inserted right before the first
backward node and read by it, as :mod:`checkmate.trace` models an
op's scratch space (:func:`with_ballast`). Any schedule of that graph within ``peak`` bytes
holds at most ``boundary`` bytes when the backward starts, and is a schedule of the
original graph once the ballast's steps are dropped (:func:`without_ballast`); the one
simulator then checks it on the original graph (:func:`solvers.api.solve`).
"""

from __future__ import annotations

from dataclasses import replace

from solvers.graph import Graph, Node
from solvers.schedule import Schedule, simulate

__all__ = ["BALLAST", "boundary_hold", "with_ballast", "without_ballast"]

#: name of the ballast node (see the module docstring)
BALLAST = "__boundary_ballast__"


def boundary_hold(graph: Graph, schedule: Schedule) -> int:
    """Bytes resident right before ``schedule``'s first compute of a backward node (what the
    forward hands to the backward, and its outputs): :attr:`SimResult.boundary`, which a
    caller that has simulated the schedule reads instead."""
    return simulate(graph, schedule).boundary


def with_ballast(graph: Graph, peak: int, boundary: int) -> tuple[Graph, int]:
    """``graph`` with a zero-cost *ballast* node inserted right before its first backward
    node and read by it (nodes from there on move up by one), and the ballast's id.

    The ballast holds ``peak - boundary`` bytes less that node's output. Every strategy
    computes nodes for the first time in id order (each is checked: :func:`solvers.api.solve`
    measures the bound on the plan it returns), so that node is the first backward op a
    schedule runs; the ballast is resident beside it then, and any schedule of the result
    within ``peak`` bytes holds at most ``boundary`` bytes right before its backward starts.
    The ballast is freed once that node has run: the rest of the backward does not carry it.

    Raises:
        ValueError: the graph has no backward node, or ``boundary`` is negative.
    """
    at = graph.first_backward
    if at >= graph.n:
        raise ValueError(f"graph {graph.name!r} has no backward node: it has no forward/backward boundary")
    if boundary < 0:
        raise ValueError(f"a boundary of {boundary} bytes: it must be >= 0")
    ballast = max(peak - boundary - int(graph.mem[at]), 0)
    shift = lambda i: i + 1 if i >= at else i  # noqa: E731
    nodes = [replace(nd, id=shift(nd.id)) for nd in graph.nodes]
    nodes.insert(at, Node(id=at, name=BALLAST, cost=0.0, mem=ballast, backward=True, key=BALLAST))
    edges = [(shift(u), shift(v)) for u, v in graph.edges] + [(at, at + 1)]
    return Graph(tuple(nodes), tuple(sorted(edges)), name=graph.name, meta=graph.meta), at


def without_ballast(schedule: Schedule, at: int) -> Schedule:
    """The schedule of the original graph: ``schedule`` (of :func:`with_ballast`'s graph,
    ballast ``at``) without the ballast's steps, the ids after it moved back down. Its stage
    matrices are dropped (the ballast's stage has no counterpart)."""
    steps = tuple((op, i - 1 if i > at else i) for op, i in schedule.steps if i != at)
    return Schedule(steps)
