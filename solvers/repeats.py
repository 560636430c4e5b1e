"""Repeated structure: runs of identical blocks (a transformer's layers, a ResNet stage's
identical bottlenecks) found in a :class:`~solvers.graph.Graph`.

A *block* is a contiguous range of node ids ``[s, s + L)``, all forward or all backward.
Two blocks of the same length are *copies* when, node by node (offset ``o``), they have the
same op, output size, recomputable flag and (within ``cost_rtol``) cost; the same edges
inside the block after the offset (``(s + a, s + b)`` in one iff ``(s' + a, s' + b)`` in
the other); and the same number of edges entering offset ``o`` from outside the block (their
sources may differ: layer j reads layer j-1's output). A *run* is k >= 2 consecutive
copies ``s, s + L, ..., s + (k-1) L``.

How (no pairwise loop over nodes):

1. Candidate periods L: each node gets a label (op, size, flags, in/out degree, the capped
   distances to its producers); for every node, the gaps to the next few nodes with its
   label are counted. A run of k copies of length L makes L a frequent gap (about
   (k-1) L times): the most frequent gaps are the candidates.
2. For a candidate L and each phase ``p`` (block starts at ``p mod L``), a node's signature
   is a 64-bit hash of its label and of its producers' distances, an edge counting as
   internal when the distance is at most the node's offset in its block (and as "from
   outside" otherwise). Block b equals block b+1 when every node's signature (and cost)
   equals that of the node L later; consecutive equal pairs chain into runs. One phase is
   O(E) numpy, so a candidate costs O(L E).
3. Runs are taken largest coverage (copies x length) first, then shortest length, then
   cut at the same phase as the largest run of that length, never overlapping; each kept run is checked node by node in Python (hash collisions split it).

Exact in what it reports (every reported copy is one by the definition above); heuristic in
what it may miss (a period that is not among the candidates). Costs of profiled graphs are
noisy: ``cost_rtol=None`` compares structure only (op, size, edges).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

from solvers.graph import Graph

__all__ = ["RepeatRun", "Repeats", "find_repeats", "edge_classes"]

IntArray = npt.NDArray[np.int64]

#: producer distances beyond this are one bucket in the candidate labels
_CAP = 64
#: how many next occurrences of a label each node measures its gap to
_NEXT = 16
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class RepeatRun:
    """k >= 2 consecutive copies of one block.

    Attributes:
        starts: the first node id of each copy, ascending (``starts[j+1] - starts[j] ==
            length``).
        length: nodes per copy.
        backward: True for a run of backward nodes.
    """

    starts: tuple[int, ...]
    length: int
    backward: bool

    @property
    def copies(self) -> int:
        return len(self.starts)

    @property
    def blocks(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` id range of each copy."""
        return tuple((s, s + self.length) for s in self.starts)

    @property
    def covered(self) -> int:
        """Nodes in the run (copies x length)."""
        return self.copies * self.length

    @property
    def span(self) -> tuple[int, int]:
        """``(first id, one past the last id)`` of the run."""
        return self.starts[0], self.starts[-1] + self.length

    def locate(self, node: int) -> tuple[int, int] | None:
        """``(copy index, offset)`` of ``node`` in this run, or None outside it."""
        lo, hi = self.span
        if not lo <= node < hi:
            return None
        return divmod(node - lo, self.length)

    def node(self, copy: int, offset: int) -> int:
        """The node at ``offset`` of copy ``copy``."""
        return self.starts[copy] + offset


@dataclass(frozen=True)
class Repeats:
    """The runs of a graph, largest coverage first, pairwise disjoint.

    Attributes:
        runs: the runs found (empty when none).
        cost_rtol: the relative cost tolerance the copies were compared with (None: costs
            ignored, structure only).
    """

    runs: tuple[RepeatRun, ...]
    cost_rtol: float | None

    @property
    def largest(self) -> RepeatRun | None:
        """The run covering the most nodes (forward or backward), or None."""
        return self.runs[0] if self.runs else None

    @cached_property
    def where(self) -> Mapping[int, tuple[int, int, int]]:
        """node -> ``(run index, copy index, offset)`` for every node in a run."""
        out: dict[int, tuple[int, int, int]] = {}
        for r, run in enumerate(self.runs):
            for c, s in enumerate(run.starts):
                for o in range(run.length):
                    out[s + o] = (r, c, o)
        return out

    def locate(self, node: int) -> tuple[int, int, int] | None:
        """``(run index, copy index, offset)`` of ``node``, or None outside every run."""
        return self.where.get(node)

    def describe(self, limit: int = 3) -> str:
        """One line: the largest runs as ``copies x length`` with their id spans."""
        if not self.runs:
            return "no repeated blocks"
        parts = [
            f"{r.copies} x {r.length} {'backward' if r.backward else 'forward'} nodes at "
            f"{r.span[0]}..{r.span[1] - 1}"
            for r in self.runs[:limit]
        ]
        more = len(self.runs) - limit
        tol = "costs ignored" if self.cost_rtol is None else f"costs within {self.cost_rtol:g}"
        return "; ".join(parts) + (f"; {more} more" if more > 0 else "") + f" ({tol})"


def find_repeats(
    graph: Graph,
    *,
    cost_rtol: float | None = 1e-6,
    periods: int = 6,
) -> Repeats:
    """Find the runs of repeated blocks of ``graph`` (see the module docstring).

    Args:
        graph: the graph.
        cost_rtol: copies' costs must agree within this relative tolerance (of the larger);
            None compares op, size and edges only (profiled costs are noisy).
        periods: how many candidate block lengths to try (the most frequent label gaps).

    Returns:
        The runs, largest coverage first, disjoint; empty when nothing repeats.
    """
    n = graph.n
    if n < 2:
        return Repeats((), cost_rtol)
    e = graph.edge_array.reshape(-1, 2)
    dst = e[:, 1]
    dist = dst - e[:, 0]
    base = _base_labels(graph)
    chains: list[tuple[int, int, int, int]] = []  # (-covered, length, start, copies)
    for length in _candidate_periods(graph, base, periods):
        chains += _chains(graph, base, cost_rtol, dst, dist, length)
    chains.sort()
    # among equal coverage, prefer the phase of the largest run of that length (layers
    # cut at the same boundaries), then the earliest start
    ref: dict[int, int] = {}
    for _, length, start, _ in chains:
        ref.setdefault(length, start % length)
    chains.sort(key=lambda c: (c[0], c[1], c[2] % c[1] != ref[c[1]], c[2]))
    taken = np.zeros(n, dtype=bool)
    runs: list[RepeatRun] = []
    for _, length, start, copies in chains:
        stop = start + copies * length
        if taken[start:stop].any():
            continue
        for run in _verified(graph, start, length, copies, cost_rtol):
            lo, hi = run.span
            if not taken[lo:hi].any():
                taken[lo:hi] = True
                runs.append(run)
    runs.sort(key=lambda r: (-r.covered, r.length, r.starts[0]))
    return Repeats(tuple(runs), cost_rtol)


def edge_classes(graph: Graph, repeats: Repeats) -> IntArray:
    """Which edges are copies of each other: ``cls[k]`` for edge ``k`` of
    ``graph.edge_array`` is the index of the first copy's edge it corresponds to (``k``
    itself outside every run).

    Edge ``(u, r)`` with u at offset o of copy 0 corresponds in copy c to ``(u', r')`` with
    u' at offset o of copy c and r' the node as far from r as u' from u when both lie in
    the run; when r lies outside the run (a later layer, the backward), r' is u''s
    consumer of the same rank (when u and u' have as many consumers). Edges with no such
    image stay alone.
    """
    e = graph.edge_array.reshape(-1, 2)
    cls = np.arange(len(e), dtype=np.int64)
    index = {(u, r): k for k, (u, r) in enumerate(e.tolist())}
    succs = graph.succs
    for run in repeats.runs:
        lo, hi = run.span
        s0 = run.starts[0]
        for u in range(s0, s0 + run.length):
            for i, r in enumerate(succs[u]):
                k = index[(u, r)]
                for start in run.starts[1:]:
                    delta = start - s0
                    u2 = u + delta
                    if lo <= r < hi:
                        r2 = r + delta if r + delta < hi else -1
                    else:
                        r2 = succs[u2][i] if len(succs[u2]) == len(succs[u]) else -1
                    k2 = index.get((u2, r2))
                    if k2 is not None:
                        cls[k2] = k
    return cls


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser: a bijective scramble of 64-bit words (wrapping)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _base_labels(graph: Graph) -> IntArray:
    """Dense labels of (op, size, backward, recomputable): what copies share node by node."""
    table: dict[tuple[str, int, bool, bool], int] = {}
    labels = [
        table.setdefault((nd.op, nd.mem, nd.backward, nd.recomputable), len(table)) for nd in graph.nodes
    ]
    return np.asarray(labels, dtype=np.int64)


def _candidate_periods(graph: Graph, base: IntArray, periods: int) -> list[int]:
    """The most frequent gaps between a node and the next nodes with its label."""
    n = graph.n
    rich: dict[tuple[int, ...], int] = {}
    indeg = [len(p) for p in graph.preds]
    outdeg = [len(s) for s in graph.succs]
    labels = np.empty(n, dtype=np.int64)
    for v in range(n):
        ds = tuple(sorted(min(v - p, _CAP) for p in graph.preds[v]))
        labels[v] = rich.setdefault((int(base[v]), indeg[v], outdeg[v], *ds), len(rich))
    order = np.lexsort((np.arange(n), labels))
    lab = labels[order]
    gaps: list[IntArray] = []
    for m in range(1, min(_NEXT, n - 1) + 1):
        same = lab[m:] == lab[:-m]
        gaps.append((order[m:] - order[:-m])[same])
    allgaps = np.concatenate(gaps) if gaps else np.zeros(0, dtype=np.int64)
    allgaps = allgaps[(allgaps > 0) & (allgaps <= n // 2)]
    if allgaps.size == 0:
        return []
    counts = np.bincount(allgaps)
    top = np.argsort(-counts, kind="stable")[:periods]
    return [int(g) for g in top if counts[g] > 0]


def _chains(
    graph: Graph,
    base: IntArray,
    rtol: float | None,
    dst: IntArray,
    dist: IntArray,
    length: int,
) -> list[tuple[int, int, int, int]]:
    """Every maximal chain of >= 2 equal consecutive blocks of ``length``, over all phases,
    as ``(-covered, length, start, copies)`` (hash equality; verified later)."""
    n = graph.n
    ids = np.arange(n, dtype=np.int64)
    label = _mix(base.astype(np.uint64))
    edge_in = _mix(dist.astype(np.uint64) + np.uint64(1 << 40))
    edge_out = np.uint64(0x5BD1E995)
    cost = graph.cost
    cost_pair = None if rtol is None else np.isclose(cost[:-length], cost[length:], rtol=rtol, atol=0.0)
    bwd = graph.backward_mask.astype(np.int64)
    out: list[tuple[int, int, int, int]] = []
    for phase in range(length):
        offset = (ids - phase) % length
        inside = dist <= offset[dst]
        sig = label.copy()
        with np.errstate(over="ignore"):
            np.add.at(sig, dst, np.where(inside, edge_in, edge_out))
        eq = sig[:-length] == sig[length:]
        if cost_pair is not None:
            eq &= cost_pair
        # block b = [phase + b L, phase + (b+1) L); pair b ~ b+1 needs eq on block b
        nb = (n - phase) // length
        if nb < 2:
            continue
        eq_full = np.zeros(nb * length, dtype=bool)
        m = min(len(eq) - phase, nb * length)
        eq_full[:m] = eq[phase : phase + m]
        pair = np.asarray(eq_full.reshape(nb, length).all(axis=1))[: nb - 1]
        kind = bwd[phase : phase + nb * length].reshape(nb, length).sum(axis=1)
        pure = (kind == 0) | (kind == length)
        pair &= pure[:-1] & pure[1:]
        for b0, b1 in _true_runs(pair):
            copies = b1 - b0 + 1
            out.append((-copies * length, length, phase + b0 * length, copies))
    return out


def _true_runs(mask: npt.NDArray[np.bool_]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each maximal run of True in ``mask``."""
    padded = np.concatenate(([False], mask, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _block_key(graph: Graph, start: int, length: int) -> tuple[object, ...]:
    """What copies share, computed exactly from the node and edge lists."""
    rows: list[tuple[object, ...]] = []
    for o in range(length):
        nd = graph.nodes[start + o]
        internal = tuple(p - start for p in graph.preds[start + o] if p >= start)
        external = sum(1 for p in graph.preds[start + o] if p < start)
        rows.append((nd.op, nd.mem, nd.backward, nd.recomputable, internal, external))
    return tuple(rows)


def _verified(graph: Graph, start: int, length: int, copies: int, rtol: float | None) -> list[RepeatRun]:
    """The chain checked pair by pair without hashing; a mismatch splits it."""
    keys = [_block_key(graph, start + j * length, length) for j in range(copies)]
    cost = graph.cost
    ok = []
    for j in range(copies - 1):
        a, b = start + j * length, start + (j + 1) * length
        same = keys[j] == keys[j + 1]
        if same and rtol is not None:
            same = bool(np.allclose(cost[a : a + length], cost[b : b + length], rtol=rtol, atol=0.0))
        ok.append(same)
    runs = []
    for b0, b1 in _true_runs(np.asarray(ok, dtype=bool)):
        starts = tuple(start + j * length for j in range(b0, b1 + 1))
        runs.append(RepeatRun(starts, length, bool(graph.nodes[starts[0]].backward)))
    return runs
