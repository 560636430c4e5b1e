"""Graph reductions before solving, as cvxpy-style pairs: ``reduce_graph`` returns a smaller
problem and the data to map its schedule back with ``expand_schedule``.

Every step either preserves the optimum or is reported as a restriction
(``ReductionInverse.restrictions``). "Optimum" means that of the frontier-advancing space the
Checkmate MILP, LP rounding and CP-SAT search (first computes follow id order; Jain et al.,
MLSys 2020): a reduced schedule of that kind expands to one with the same peak and cost plus
``cost_offset``, and every schedule of the original graph is matched by one as cheap.

Steps:

1. **Fold zero-byte nodes** (exact). A node v with ``mem == 0`` can be computed once and kept
   for ever at no memory: in any schedule, drop its recomputes and frees and nothing else
   changes. If all of v's inputs but at most one (``p``) are themselves folded, v can run
   right after p's first compute (p is resident then, and folded inputs already are), so v
   leaves the problem: its edges go, its cost becomes a constant, and ``expand_schedule``
   inserts it after p's first compute. (The PyTorch front end already folds views into
   their bases; this catches what is left, e.g. constants and empty outputs.)
2. **Fix nodes that need one compute** (exact): zero-byte nodes that could not be folded,
   nodes nobody reads, and non-recomputable nodes (random ops, side effects) are listed in
   ``fixed_once`` and in ``reduced.meta["fixed_once"]``; formulations fix their R rows.
3. **Backward nodes once** (``backward_once=True``, a restriction): backward ops join
   ``fixed_once``. Optimal plans rarely recompute gradients, and the model shrinks.

Not done, and why: merging a chain u -> v into one node hides the moment both outputs are
resident (computing v allocates its output while u is alive), so the merged node either
understates the peak (the expanded schedule may break the budget) or must charge
``mem_u + mem_v`` for its whole lifetime (a loose restriction). It is exact only when
``mem_u == 0``, which step 1 covers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from solvers.errors import ScheduleError
from solvers.graph import Graph
from solvers.schedule import COMPUTE, Schedule, Step

__all__ = ["ReductionInverse", "reduce_graph", "expand_schedule"]


@dataclass(frozen=True)
class ReductionInverse:
    """What :func:`expand_schedule` needs to map a reduced schedule back.

    Attributes:
        original: the graph before reduction.
        kept: reduced id -> original id.
        folded: original ids of the folded zero-byte nodes, ascending.
        anchor: per folded node, the original id after whose first compute it runs
            (-1: before everything).
        fixed_once: bool per reduced node: computed exactly once in some optimal plan
            (or by restriction, see ``restrictions``).
        cost_offset: cost of the folded nodes (each computed once).
        restrictions: the steps that may lose optimality; empty when exact.
    """

    original: Graph
    kept: tuple[int, ...]
    folded: tuple[int, ...]
    anchor: tuple[int, ...]
    fixed_once: npt.NDArray[np.bool_]
    cost_offset: float
    restrictions: tuple[str, ...]

    @property
    def exact(self) -> bool:
        """True when the reduced problem has the original's optimum (up to the offset)."""
        return not self.restrictions


def reduce_graph(
    graph: Graph, *, fold_zero_bytes: bool = True, backward_once: bool = False
) -> tuple[Graph, ReductionInverse]:
    """Reduce ``graph`` for the planners (see the module docstring for each step).

    Args:
        graph: the graph to reduce.
        fold_zero_bytes: remove zero-byte nodes whose inputs allow it (exact).
        backward_once: fix backward nodes to one compute (a restriction).

    Returns:
        ``(reduced, inverse)``; ``reduced.meta["fixed_once"]`` lists the reduced ids whose
        R rows may be fixed, ``reduced.meta["reduction"]`` summarizes the steps.

    Example:
        >>> reduced, inv = reduce_graph(graph)  # doctest: +SKIP
        >>> expand_schedule(solve(reduced, budget).schedule, inv)  # doctest: +SKIP
    """
    n = graph.n
    mem = graph.mem
    folded = np.zeros(n, dtype=bool)
    anchor = np.full(n, -1, dtype=np.int64)
    if fold_zero_bytes:
        for v in range(n):
            if mem[v] != 0:
                continue
            live = [p for p in graph.preds[v] if not folded[p]]
            inherited = max((int(anchor[p]) for p in graph.preds[v] if folded[p]), default=-1)
            if len(live) > 1 or (live and live[0] < inherited):
                continue
            folded[v] = True
            anchor[v] = live[0] if live else inherited
    kept = np.flatnonzero(~folded)
    new_id = np.full(n, -1, dtype=np.int64)
    new_id[kept] = np.arange(kept.size)
    has_reader = np.zeros(n, dtype=bool)
    if graph.edges:
        e = graph.edge_array
        has_reader[e[:, 0][~folded[e[:, 1]]]] = True  # readers that stay in the problem
    once = (mem == 0) | ~has_reader | ~graph.recomputable_mask
    restrictions: list[str] = []
    if backward_once:
        once |= graph.backward_mask
        restrictions.append("backward nodes computed once")
    fixed = once[kept]
    nodes = tuple(dataclasses.replace(graph.nodes[int(o)], id=int(r)) for r, o in enumerate(kept))
    edges = tuple((int(new_id[u]), int(new_id[v])) for u, v in graph.edges if not (folded[u] or folded[v]))
    meta = {
        **dict(graph.meta),
        "fixed_once": tuple(int(i) for i in np.flatnonzero(fixed)),
        "reduction": {
            "original_nodes": n,
            "folded_zero_bytes": int(folded.sum()),
            "fixed_once": int(fixed.sum()),
            "restrictions": list(restrictions),
        },
    }
    reduced = Graph(nodes, edges, name=graph.name, meta=meta)
    fold_ids = np.flatnonzero(folded)
    inverse = ReductionInverse(
        original=graph,
        kept=tuple(int(i) for i in kept),
        folded=tuple(int(i) for i in fold_ids),
        anchor=tuple(int(anchor[i]) for i in fold_ids),
        fixed_once=fixed,
        cost_offset=float(graph.cost[fold_ids].sum()),
        restrictions=tuple(restrictions),
    )
    return reduced, inverse


def expand_schedule(schedule: Schedule, inverse: ReductionInverse) -> Schedule:
    """Map a schedule of the reduced graph to the original graph.

    Folded nodes are computed once, right after their anchor's first compute (or first of
    all), and never freed; kept nodes keep their steps, renamed to original ids.

    Raises:
        ScheduleError: a reader of a folded node is computed before that node's anchor
            (the reduced schedule's first computes are not in id order, which the fold
            assumes), or the schedule names a node the reduced graph does not have.
    """
    kept = inverse.kept
    by_anchor: dict[int, list[int]] = {}
    for v, a in zip(inverse.folded, inverse.anchor):
        by_anchor.setdefault(a, []).append(v)
    original = inverse.original
    placed = np.zeros(original.n, dtype=bool)
    steps: list[Step] = []

    folded_mask = np.zeros(original.n, dtype=bool)
    folded_mask[list(inverse.folded)] = True

    def check(o: int) -> None:
        for p in original.preds[o]:
            if folded_mask[p] and not placed[p]:
                raise ScheduleError(
                    f"node {original.nodes[o].name!r} is computed before its zero-byte input "
                    f"{original.nodes[p].name!r} can be placed: the zero-byte fold assumes "
                    "first computes in id order; reduce with fold_zero_bytes=False"
                )

    def place(a: int) -> None:
        for v in by_anchor.pop(a, ()):
            check(v)
            steps.append((COMPUTE, v))
            placed[v] = True

    place(-1)
    for op, i in schedule.steps:
        if not 0 <= i < len(kept):
            raise ScheduleError(f"step ({op}, {i}) names a node the reduced graph does not have")
        o = kept[i]
        if op == COMPUTE:
            check(o)
        steps.append((op, o))
        if op == COMPUTE:
            place(o)
    return Schedule(tuple(steps))
