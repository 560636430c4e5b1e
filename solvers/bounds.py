"""Cheap lower bounds on the peak memory of every schedule of a graph.

Computing node v needs its output and all of its inputs resident at once (Jain et al.,
"Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization", MLSys 2020,
the memory constraint at the step that computes v), so no schedule, with or without
recomputation, peaks below the largest such working set. With paging to host memory
(POET, Patil et al., ICML 2022) that bound is attained: page every value out after
computing it and each input in for the op that reads it.

This module depends only on the graph, so the front door (:mod:`solvers.api`) and every
strategy can import it without importing each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from solvers.graph import Graph
from solvers.result import SolveResult, Status

__all__ = ["memory_lower_bound", "largest_working_set", "below_floor"]


def memory_lower_bound(graph: Graph) -> int:
    """A cheap bound every schedule's peak reaches: the largest working set of one op
    (its output plus all its inputs resident at once); 0 for an empty graph."""
    return int(_working_sets(graph).max()) if graph.n else 0


def _working_sets(graph: Graph) -> np.ndarray:
    """Per node, the bytes of its output and all its inputs."""
    need = graph.mem.astype(np.int64).copy()
    if graph.edges:
        e = graph.edge_array
        np.add.at(need, e[:, 1], graph.mem[e[:, 0]])
    return need


def largest_working_set(graph: Graph) -> str:
    """Which op sets :func:`memory_lower_bound`, for an error message: its name, the bytes
    of its output and of its inputs, and its largest input (an op's scratch space is an
    input of its own, ``<op>.workspace``: see :mod:`checkmate.trace`); empty for an empty
    graph."""
    if not graph.n:
        return ""
    from solvers.budget import format_bytes

    need = _working_sets(graph)
    v = int(need.argmax())
    node, preds = graph.nodes[v], graph.preds[v]
    msg = f"{_label(node.name, node.op)} needs {format_bytes(int(need[v]))}: {format_bytes(int(node.mem))} output"
    if not preds:
        return msg
    msg += f" + {format_bytes(int(need[v]) - int(node.mem))} in {len(preds)} input{'' if len(preds) == 1 else 's'}"
    big = graph.nodes[max(preds, key=lambda u: int(graph.mem[u]))]
    kind = "its scratch space" if big.op == "workspace" else "the largest"
    return msg + f", {kind} {big.name} {format_bytes(int(big.mem))}"


def _label(name: str, op: str) -> str:
    """A node's name, with its op where the name is a ``getitem``'s (one output of a multi-output
    op: "getitem_6 needs 13.90 MiB" named no op a user would know of a conv3d's backward)."""
    if not name.startswith("getitem") or not op or "getitem" in op:
        return name
    parts = op.split(".")
    short = parts[1] if len(parts) >= 3 and parts[0] == "aten" else op
    return f"{name} (an output of {short})"


def below_floor(
    strategy: str, graph: Graph, budget: int, *, exact: bool = False, **info: Any
) -> SolveResult | None:
    """The INFEASIBLE result a strategy returns for a budget below
    :func:`memory_lower_bound`, or None when the budget reaches it.

    Args:
        strategy: the strategy's name (recorded in the result).
        graph: the graph.
        budget: the budget in bytes.
        exact: the bound is the strategy's minimum feasible budget (POET with paging).
        info: more entries for ``info`` (e.g. the host link).
    """
    floor = memory_lower_bound(graph)
    if budget >= floor:
        return None
    info.update(min_budget=floor, min_budget_exact=exact, reason="largest op working set")
    return SolveResult(strategy, Status.INFEASIBLE, budget, info=info)
