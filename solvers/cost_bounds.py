"""A cheap lower bound on the cost of every schedule of a graph within a memory budget.

The trivial bound is the cost of computing every node once. This one adds what a budget
forces to be recomputed, from the memory at one instant (the Checkmate memory constraint,
Jain et al., MLSys 2020, at a single stage, with the recomputations' own inputs ignored):

When node j is first computed, every value v computed before it (``v < j``) and read
again at or after it (``last_use[v] >= j``) is either resident, or computed again later:
an extra cost of at least ``cost[v]``. The resident ones, with j's output, fit in the
budget. Values j reads, and values that cannot be recomputed, must be resident. So the
extra cost at j is at least the least cost of the values left out, a 0/1 knapsack whose
LP relaxation (keep values in decreasing order of cost per byte, the last one in part)
is solved by one sort. The bound is the total cost plus the largest such extra over the
instants j.

Like the Checkmate MILP and its LP relaxation, it holds for schedules that compute nodes
for the first time in id order (the frontier-advancing stages of the formulation), which
is what the strategies here return. On a traced Llama-2-7B-shaped step it equals the LP
relaxation of the same memory rows at every tenth stage to within 0.1 % of the step's
cost, at a fraction of the time.
"""

from __future__ import annotations

import numpy as np

from solvers.graph import Graph

__all__ = ["recompute_lower_bound"]


def recompute_lower_bound(graph: Graph, budget: int) -> float | None:
    """A lower bound on the cost of any schedule of ``graph`` peaking at most ``budget``.

    Args:
        graph: the graph.
        budget: bytes.

    Returns:
        At least ``graph.total_cost`` (see the module docstring); None when the budget is
        below the bytes that must be resident at some instant (no schedule fits).

    Example:
        >>> from tests.graphs import chain  # doctest: +SKIP
        >>> recompute_lower_bound(chain(8, training=True), 6)  # doctest: +SKIP
    """
    n = graph.n
    if n == 0:
        return 0.0
    mem = graph.mem.astype(np.int64)
    cost = graph.cost.astype(np.float64)
    last = graph.last_use
    rec = graph.recomputable_mask
    preds = graph.preds
    created = np.arange(n)
    extra = 0.0
    for j in range(n):
        live = (created < j) & (last >= j)
        if int(mem[live].sum()) + int(mem[j]) <= budget:
            continue  # everything live fits: nothing forced at this instant
        forced = live & ~rec
        forced[list(preds[j])] = True  # j's inputs (all live: they were computed before j)
        cap = budget - int(mem[j]) - int(mem[forced].sum())
        if cap < 0:
            return None
        cand = np.flatnonzero(live & ~forced & (mem > 0))
        order = cand[np.argsort(-cost[cand] / mem[cand], kind="stable")]
        kept_bytes = np.cumsum(mem[order])
        k = int(np.searchsorted(kept_bytes, cap, side="right"))  # whole values kept
        dropped = float(cost[order[k:]].sum())
        if k < len(order):  # the next one kept in part
            room = cap - (int(kept_bytes[k - 1]) if k else 0)
            dropped -= float(cost[order[k]]) * room / float(mem[order[k]])
        extra = max(extra, dropped)
    return graph.total_cost + extra
