"""Carry a schedule over to the same graph at other tensor sizes.

A training loop whose batches change shape gives torch.compile one joint graph per shape:
the same ops in the same order (same node keys, same edges), with other sizes. A schedule
of one of them is a schedule of any other once its steps are renamed by node key; only its
peak changes, and :func:`transfer` lets the simulator say whether it still fits.

Scratch-space nodes (``op == "workspace"``, see ``checkmate.trace``) come and go with the
sizes (an op needs scratch at one size and none at another): a workspace absent from the
new graph is dropped from the schedule, and one that only the new graph has is computed
right before each compute of the op that reads it and freed right after it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import replace

from solvers.errors import ScheduleError
from solvers.graph import Graph
from solvers.schedule import COMPUTE, FREE, Schedule, SimResult, Step, validate

__all__ = ["WORKSPACE_OP", "stretch", "structure", "transfer", "transfer_and_check"]

#: ``Node.op`` of a scratch-space node
WORKSPACE_OP = "workspace"


def structure(graph: Graph) -> tuple[Hashable, ...]:
    """What two graphs must share for a schedule of one to run on the other: node keys,
    ops, flags and edges, scratch-space nodes left out. Sizes, costs and the node order are
    not part of it (``checkmate.trace`` orders some backward ops by their sizes; a schedule
    names nodes, and any order of the same DAG runs it)."""
    keep = [node for node in graph.nodes if node.op != WORKSPACE_OP]
    ids = {node.id for node in keep}
    nodes = frozenset((node.ext, node.op, node.backward, node.recomputable) for node in keep)
    edges = frozenset(
        (graph.nodes[u].ext, graph.nodes[v].ext) for u, v in graph.edges if u in ids and v in ids
    )
    return (nodes, edges)


def transfer(old: Graph, schedule: Schedule, new: Graph) -> Schedule | None:
    """``schedule`` of ``old`` as a schedule of ``new`` (steps matched by node key), or
    None when the two graphs differ in more than sizes, costs and scratch-space nodes.

    Paging steps are kept as they are. The result is not checked: see
    :func:`transfer_and_check`.
    """
    if structure(old) != structure(new):
        return None
    index = {node.ext: node.id for node in new.nodes}
    # scratch-space nodes only ``new`` has: workspace id -> the op it serves (its only reader)
    succs = new.succs
    fresh: dict[int, int] = {}
    old_keys = {node.ext for node in old.nodes}
    for node in new.nodes:
        if node.op == WORKSPACE_OP and node.ext not in old_keys:
            if len(succs[node.id]) != 1:
                return None
            fresh[succs[node.id][0]] = node.id
    steps: list[Step] = []
    for op, i in schedule.steps:
        j = index.get(old.nodes[i].ext)
        if j is None:
            if old.nodes[i].op == WORKSPACE_OP:
                continue  # no scratch at the new sizes
            return None
        if op == COMPUTE and j in fresh:
            w = fresh[j]
            steps += [(COMPUTE, w), (COMPUTE, j), (FREE, w)]
        else:
            steps.append((op, j))
    return Schedule(tuple(steps))


def transfer_and_check(
    old: Graph, schedule: Schedule, new: Graph, budget: int | None
) -> tuple[Schedule, SimResult] | None:
    """:func:`transfer`, then :func:`~solvers.schedule.validate` on ``new`` within
    ``budget``: the schedule and its simulation, or None when it does not carry over or
    does not fit."""
    moved = transfer(old, schedule, new)
    if moved is None:
        return None
    try:
        return moved, validate(new, moved, budget)
    except ScheduleError:
        return None


def stretch(old: Graph, new: Graph, factor: float = 2.0) -> Graph | None:
    """``new`` with its sizes extrapolated to a larger shape, from how they grew since ``old``.

    Each node's bytes grow as a power of the shape's size: a node that grew by ``r`` while
    the typical growing node grew by ``R`` (the median ratio) is a power ``ln r / ln R`` of
    the size, and gets ``mem * factor ** (ln r / ln R)``: a size that doubles (``factor`` 2)
    doubles a node linear in it, quadruples a quadratic one (attention scores) and leaves
    a constant one (a weight's gradient) alone. A plan of the stretched graph, carried back
    to ``new``, leaves room for shapes up to about ``factor`` times larger. Nodes only
    ``new`` has (scratch space) keep their bytes.

    Returns:
        The stretched graph (same nodes, edges and costs as ``new``), or None when ``new``
        is no larger than ``old`` anywhere or the two are not the same graph.
    """
    if structure(old) != structure(new):
        return None
    before = {node.ext: node.mem for node in old.nodes}
    ratios = {
        node.id: node.mem / before[node.ext]
        for node in new.nodes
        if before.get(node.ext, 0) > 0 and node.mem > before[node.ext]
    }
    if not ratios:
        return None
    typical = sorted(ratios.values())[len(ratios) // 2]
    if typical <= 1.0:
        return None
    nodes = tuple(
        replace(node, mem=math.ceil(node.mem * factor ** (math.log(ratios[node.id]) / math.log(typical))))
        if node.id in ratios
        else node
        for node in new.nodes
    )
    return Graph(nodes, new.edges, name=new.name, meta=dict(new.meta))
