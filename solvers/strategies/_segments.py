"""Shared machinery of the checkpointing baselines: a schedule from a set of kept values.

A checkpointing baseline (Chen et al. 2016, Griewank & Walther 2000) chooses which
forward values to keep for the backward pass. Every baseline here reduces to a *compute
sequence* (node ids, repeats allowed); :func:`solvers.schedule.schedule_from_order` then
frees each value right after its last read before its next recompute, so the memory of
a sequence is exactly what its reads require.

:func:`checkpoint_sequence` is the one generic routine: the graph runs in id order; a
forward value that is not kept is dropped after its last *forward* reader; when a later
node reads a dropped value, the missing values are recomputed (in id order) from the
nearest resident ones, and each recomputed value then stays until its last read, so a
segment between two checkpoints is recomputed at most once.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from solvers.graph import Graph
from solvers.schedule import Schedule, SimResult, schedule_from_order, simulate

__all__ = [
    "forward_ids",
    "last_forward_reader",
    "forced_keep",
    "recompute_closure",
    "checkpoint_sequence",
    "drop_sequence",
    "schedule_from_kept",
    "articulation_points",
    "sticky_values",
    "evaluate",
]

IntArray = npt.NDArray[np.int64]


def forward_ids(graph: Graph) -> IntArray:
    """Ids of the forward nodes (``backward=False``), ascending."""
    return np.flatnonzero(~graph.backward_mask).astype(np.int64)


def last_forward_reader(graph: Graph) -> IntArray:
    """``lf[u]``: the last forward node that reads u, or -1 when no forward node does."""
    lf = np.full(graph.n, -1, dtype=np.int64)
    if graph.edges:
        e = graph.edge_array
        fwd_dst = e[~graph.backward_mask[e[:, 1]]]
        np.maximum.at(lf, fwd_dst[:, 0], fwd_dst[:, 1])
    return lf


def forced_keep(graph: Graph) -> npt.NDArray[np.bool_]:
    """Values every baseline keeps: non-recomputable nodes (they may run only once) and
    forward values no forward node reads (dropping them would only force an immediate
    recompute by the backward node that reads them next)."""
    return ~graph.recomputable_mask | (last_forward_reader(graph) < 0)


def recompute_closure(graph: Graph, target: int, avail: npt.NDArray[np.bool_]) -> list[int]:
    """The nodes to compute, in id order, to make ``target`` available given ``avail``:
    ``target`` and every ancestor reached through unavailable values."""
    preds = graph.preds
    need = {target}
    stack = [target]
    while stack:
        v = stack.pop()
        for p in preds[v]:
            if not avail[p] and p not in need:
                need.add(p)
                stack.append(p)
    return sorted(need)


def checkpoint_sequence(graph: Graph, kept: Iterable[int]) -> list[int]:
    """The compute sequence of the checkpointing policy that keeps ``kept``.

    Args:
        graph: any graph (forward nodes have ``backward=False``).
        kept: forward nodes whose outputs stay until their last read; non-recomputable
            nodes and forward values without forward readers are always kept.

    Returns:
        Node ids in execution order, each node at least once, non-recomputable ones once.
    """
    keep = forced_keep(graph)
    keep[[int(k) for k in kept]] = True
    lf = last_forward_reader(graph)
    e = graph.edge_array.reshape(-1, 2)
    # each forward value not kept goes at its last forward read
    drop = ~keep[e[:, 0]] & ~graph.backward_mask[e[:, 0]] & (e[:, 1] == lf[e[:, 0]])
    return drop_sequence(graph, drop)[0]


def drop_sequence(
    graph: Graph, drop: npt.NDArray[np.bool_], *, transient: bool = False
) -> tuple[list[int], list[int]]:
    """The compute sequence of a policy that drops values at chosen reads.

    The general form of :func:`checkpoint_sequence`, for any graph (inference graphs
    included): ``drop[k]`` says that the value ``u`` of edge ``k = (u, r)`` of
    ``graph.edge_array`` is dropped right after node r first runs; a later reader then
    recomputes it (with its dropped ancestors, in id order) and it stays until its next
    drop point or last read. Keeping the forward values outside a kept set is
    ``drop = (u, last forward reader of u)`` for every other forward value.

    With ``transient``, the ancestors a recompute needed are dropped again right after it
    (only the value asked for stays): a later reader recomputes them rather than the
    schedule holding them to their last read.

    Returns:
        ``(seq, owner)``: node ids in execution order (each node at least once), and for
        each entry the node of the program (the id-order run) it was computed for.
    """
    n = graph.n
    e = graph.edge_array
    drop_after: list[list[int]] = [[] for _ in range(n)]
    if e.size:
        for u, r in e[np.asarray(drop, dtype=bool)].tolist():
            drop_after[r].append(u)
    preds = graph.preds
    avail = np.zeros(n, dtype=bool)
    seq: list[int] = []
    owner: list[int] = []
    for v in range(n):
        for p in preds[v]:
            if not avail[p]:
                closure = recompute_closure(graph, p, avail)
                for w in closure:
                    seq.append(w)
                    owner.append(v)
                    avail[w] = True
                if transient:
                    avail[closure[:-1]] = False  # closure is sorted: p, the target, is last
        seq.append(v)
        owner.append(v)
        avail[v] = True
        for u in drop_after[v]:
            avail[u] = False
    return seq, owner


def schedule_from_kept(graph: Graph, kept: Iterable[int]) -> Schedule:
    """:func:`checkpoint_sequence` turned into steps (each value freed after its last read)."""
    return schedule_from_order(graph, checkpoint_sequence(graph, kept))


def articulation_points(graph: Graph, resident: npt.NDArray[np.bool_] | None = None) -> IntArray:
    """Forward nodes that separate the forward graph in id order.

    A forward node v qualifies when no edge between forward nodes jumps over it (no
    ``(u, w)`` with ``u < v < w``): everything before v reaches everything after v only
    through v, so keeping v alone lets the segments on either side be recomputed apart.
    On a chain every node qualifies; in a ResNet, the outputs of the residual blocks.

    Args:
        graph: the graph.
        resident: values kept resident throughout (see :func:`sticky_values`); their
            edges never force a recompute across a segment, so they jump over nothing.
    """
    fwd = forward_ids(graph)
    if fwd.size == 0:
        return fwd
    pos = np.full(graph.n, -1, dtype=np.int64)
    pos[fwd] = np.arange(fwd.size)
    jumped = np.zeros(fwd.size + 1, dtype=np.int64)
    if graph.edges:
        e = graph.edge_array
        both = ~graph.backward_mask[e[:, 0]] & ~graph.backward_mask[e[:, 1]]
        if resident is not None:
            both &= ~resident[e[:, 0]]
        pu, pw = pos[e[both, 0]], pos[e[both, 1]]
        long = pw - pu > 1
        # difference array: positions pu+1 .. pw-1 are jumped over
        np.add.at(jumped, pu[long] + 1, 1)
        np.add.at(jumped, pw[long], -1)
    covered = np.cumsum(jumped[:-1]) > 0
    return fwd[~covered]


def sticky_values(graph: Graph, share: float = 0.02) -> npt.NDArray[np.bool_]:
    """Values a segmenting baseline keeps resident throughout: :func:`forced_keep`, plus
    the smallest forward values read far from where they are made (sources of edges that
    jump over other forward nodes: an attention mask every layer reads, position ids), up
    to ``share`` of the forward bytes in all. Keeping them costs little memory, and without
    them no transformer layer boundary separates the graph."""
    keep = forced_keep(graph)
    if not graph.edges:
        return keep
    e = graph.edge_array
    fwd_edge = ~graph.backward_mask[e[:, 0]] & ~graph.backward_mask[e[:, 1]]
    span = np.zeros(graph.n, dtype=np.int64)
    np.maximum.at(span, e[fwd_edge, 0], e[fwd_edge, 1] - e[fwd_edge, 0])
    cand = np.flatnonzero((span > 1) & ~keep & graph.recomputable_mask)
    if cand.size == 0:
        return keep
    cand = cand[np.argsort(graph.mem[cand], kind="stable")]
    allowance = share * float(graph.mem[forward_ids(graph)].sum())
    take = cand[np.cumsum(graph.mem[cand]) <= allowance]
    keep[take] = True
    return keep


def evaluate(graph: Graph, schedule: Schedule) -> SimResult:
    """The simulator's verdict on ``schedule`` (a thin alias kept for readability)."""
    return simulate(graph, schedule)
