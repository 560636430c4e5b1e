"""The graph IR shared by every layer: a frozen, typed DAG in topological order.

Nodes are ops; ``node.id`` is its position in a topological order (0..n-1), ``cost`` the
time to compute it (seconds or abstract units), ``mem`` the bytes of its output. Edges run
from a producer to a consumer and always point forward (``src < dst``). Graph inputs
(parameters, user inputs, tangents) are not nodes: they are always resident and outside
the budget.

Build a graph with :func:`Graph.build` (which sorts and validates arbitrary ids and edge
lists) or directly with ``Graph(nodes, edges)`` when ids are already topological.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from solvers.errors import GraphError

__all__ = ["Node", "Graph", "MAX_NODE_BYTES", "MAX_TOTAL_BYTES"]

#: A node's output must be smaller than this (2**53 bytes, 8 PiB): every size is then exact
#: as a float64 (the MILP's coefficients) and fits CP-SAT's int64 arithmetic.
MAX_NODE_BYTES = 2**53
#: The sizes of all nodes together must stay below this (2**62 bytes, 4 EiB): peaks,
#: budgets and the models' memory sums are int64 and must not overflow.
MAX_TOTAL_BYTES = 2**62

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Node:
    """One op of the graph.

    Attributes:
        id: position in the graph's topological order (0..n-1).
        name: a human-readable label (unique names are not required).
        cost: time to compute the op once (seconds or abstract units), >= 0.
        mem: bytes of the op's output, >= 0.
        backward: True for ops of the backward pass.
        recomputable: False for ops that must run exactly once (random ops, ops with
            side effects); planners keep their outputs instead of recomputing them.
        key: the node's id in the file or framework it came from (for plans that name
            nodes as the user does); defaults to ``id``.
        op: the op's kind (e.g. ``"aten.mm"``), informational.
        save_cost: time the forward spends only when it hands this value to the backward,
            charged once when the value is resident as the backward starts (a compiled
            forward that fuses the op into its reader writes the result to memory only to
            save it, and the backward reads it back: see :mod:`checkmate.fusion`); 0 for
            values the forward writes anyway.
    """

    id: int
    name: str
    cost: float
    mem: int
    backward: bool = False
    recomputable: bool = True
    key: int | str | None = None
    op: str = ""
    save_cost: float = 0.0

    @property
    def ext(self) -> int | str:
        """The external id: ``key`` if set, else ``id``."""
        return self.id if self.key is None else self.key


@dataclass(frozen=True)
class Graph:
    """A frozen DAG whose node ids are a topological order.

    Invariants (checked on construction): ``nodes[i].id == i``; every edge ``(u, v)``
    has ``0 <= u < v < n``; no duplicate edges; costs are finite and non-negative and so
    is their sum; sizes are integers in ``[0, MAX_NODE_BYTES)`` summing to less than
    ``MAX_TOTAL_BYTES`` (what int64 peaks and the solvers' models can hold).
    Derived arrays (``cost``, ``mem``, ``preds``, ``succs``, ...) are computed once.
    """

    nodes: tuple[Node, ...]
    edges: tuple[tuple[int, int], ...]
    name: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        n = len(self.nodes)
        for i, node in enumerate(self.nodes):
            if node.id != i:
                raise GraphError(
                    f"node at position {i} has id {node.id}: ids must be 0..n-1 in "
                    "topological order; use Graph.build() to sort arbitrary ids"
                )
            for what, value in (("cost", node.cost), ("save cost", node.save_cost)):
                if not isinstance(value, (int, float, np.integer, np.floating)) or not 0 <= value < math.inf:
                    raise GraphError(
                        f"node {node.ext!r} ({node.name!r}) has {what} {value!r}: {what}s must be finite numbers >= 0"
                    )
            if node.save_cost and node.backward:
                raise GraphError(
                    f"node {node.ext!r} ({node.name!r}) is a backward node with a save cost: only "
                    "forward values are handed to the backward"
                )
            if not isinstance(node.mem, (int, np.integer)) or isinstance(node.mem, bool):
                raise GraphError(
                    f"node {node.ext!r} ({node.name!r}) has size {node.mem!r}: sizes must be integers (bytes)"
                )
            if node.mem < 0:
                raise GraphError(f"node {node.ext!r} ({node.name!r}) has negative size {node.mem} bytes")
            if node.mem >= MAX_NODE_BYTES:
                raise GraphError(
                    f"node {node.ext!r} ({node.name!r}) has size {node.mem} bytes: sizes must be below "
                    f"2**53 = {MAX_NODE_BYTES:,} bytes (8 PiB)"
                )
        total_mem = sum(int(node.mem) for node in self.nodes)
        if total_mem >= MAX_TOTAL_BYTES:
            raise GraphError(
                f"the node sizes sum to {total_mem:,} bytes: the total must be below 2**62 = "
                f"{MAX_TOTAL_BYTES:,} bytes (4 EiB)"
            )
        with np.errstate(over="ignore"):
            finite_total = bool(np.isfinite(self.cost.sum()))  # total_cost, as every layer sums it
        if not finite_total:
            raise GraphError("the node costs sum to more than a float can hold: rescale the costs")
        seen: set[tuple[int, int]] = set()
        for u, v in self.edges:
            if not (0 <= u < n and 0 <= v < n):
                raise GraphError(f"edge ({u}, {v}) names a node that does not exist (n={n})")
            if u >= v:
                raise GraphError(
                    f"edge ({self.nodes[u].ext!r} -> {self.nodes[v].ext!r}) points backward in "
                    "the node order: ids must be topological; use Graph.build()"
                )
            if (u, v) in seen:
                raise GraphError(f"duplicate edge ({u}, {v})")
            seen.add((u, v))

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        nodes: Sequence[Mapping[str, Any]],
        edges: Iterable[tuple[Hashable, Hashable]],
        *,
        name: str = "",
        order: Sequence[Hashable] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Graph:
        """Build a graph from nodes with arbitrary external ids and an edge list.

        Args:
            nodes: mappings with keys ``key`` (external id, required), ``name``, ``cost``,
                ``mem`` and optionally ``backward``, ``recomputable``, ``op``, ``save_cost``.
            edges: ``(src_key, dst_key)`` pairs; duplicates are merged.
            name: the graph's name.
            order: an optional topological order of the keys to use (it is checked);
                otherwise a stable topological sort (ties broken by input position).
            meta: free-form metadata carried along.

        Raises:
            GraphError: a node without a string or integer ``key``, a cost that is not a
                finite number >= 0, a size that is not a whole number of bytes in
                ``[0, MAX_NODE_BYTES)``, sizes summing to ``MAX_TOTAL_BYTES`` or more,
                duplicate ids, dangling edges, self-loops or a cycle.
        """
        try:
            keys = [nd["key"] for nd in nodes]
        except (KeyError, TypeError, IndexError):
            raise GraphError("every node must be a mapping with a 'key' (its id)") from None
        index: dict[Hashable, int] = {}
        for pos, k in enumerate(keys):
            if not isinstance(k, Hashable) or (isinstance(k, float) and not math.isfinite(k)):
                raise GraphError(f"node #{pos} has id {k!r}: ids must be strings or integers")
            if k in index:
                raise GraphError(f"duplicate node id {k!r}")
            index[k] = pos
        n = len(keys)
        adj: list[set[int]] = [set() for _ in range(n)]
        for s, t in edges:
            if not (isinstance(s, Hashable) and isinstance(t, Hashable)):
                raise GraphError(f"edge ({s!r} -> {t!r}) must name nodes by their string or integer ids")
            if s not in index or t not in index:
                missing = s if s not in index else t
                raise GraphError(f"dangling edge ({s!r} -> {t!r}): node {missing!r} does not exist")
            if s == t:
                raise GraphError(f"self-loop on node {s!r}: the graph must be acyclic")
            adj[index[s]].add(index[t])
        if order is not None:
            if not isinstance(order, Sequence) or not all(isinstance(k, Hashable) for k in order):
                raise GraphError("the given order must be a list of node ids")
            perm = [index.get(k, -1) for k in order]
            if sorted(perm) != list(range(n)):
                raise GraphError("the given order is not a permutation of the node ids")
            rank = {p: r for r, p in enumerate(perm)}
            for u in range(n):
                for v in adj[u]:
                    if rank[u] >= rank[v]:
                        raise GraphError(f"the given order is not topological: {keys[u]!r} -> {keys[v]!r}")
        else:
            perm = _toposort(adj, keys)
        rank = {p: r for r, p in enumerate(perm)}
        new_nodes = []
        for r, p in enumerate(perm):
            nd = nodes[p]
            new_nodes.append(
                Node(
                    id=r,
                    name=str(nd.get("name", keys[p])),
                    cost=_cost(nd.get("cost", 0.0), keys[p]),
                    mem=_size(nd.get("mem", 0), keys[p]),
                    backward=bool(nd.get("backward", False)),
                    recomputable=bool(nd.get("recomputable", True)),
                    key=keys[p],  # type: ignore[arg-type]
                    op=str(nd.get("op", "")),
                    save_cost=_cost(nd.get("save_cost", 0.0), keys[p], "save cost"),
                )
            )
        new_edges = sorted((rank[u], rank[v]) for u in range(n) for v in adj[u])
        return cls(tuple(new_nodes), tuple(new_edges), name=name, meta=dict(meta or {}))

    # ------------------------------------------------------------------ derived data
    @property
    def n(self) -> int:
        """Number of nodes."""
        return len(self.nodes)

    def _column(self, field: str, dtype: Any) -> npt.NDArray[Any]:
        """The nodes' ``field`` as a read-only array of ``dtype``, in id order."""
        arr = np.array([getattr(nd, field) for nd in self.nodes], dtype=dtype)
        arr.setflags(write=False)
        return arr

    @cached_property
    def cost(self) -> FloatArray:
        """Per-node compute cost, shape (n,)."""
        return self._column("cost", np.float64)

    @cached_property
    def save_cost(self) -> FloatArray:
        """Per-node save cost (see :class:`Node`), shape (n,)."""
        return self._column("save_cost", np.float64)

    @cached_property
    def first_backward(self) -> int:
        """The id of the first backward node (``n`` when there is none): the stage at which
        the values resident pay their save costs."""
        bw = np.flatnonzero(self.backward_mask)
        return int(bw[0]) if bw.size else self.n

    @cached_property
    def mem(self) -> IntArray:
        """Per-node output bytes, shape (n,)."""
        return self._column("mem", np.int64)

    @cached_property
    def backward_mask(self) -> npt.NDArray[np.bool_]:
        return self._column("backward", bool)

    @cached_property
    def recomputable_mask(self) -> npt.NDArray[np.bool_]:
        return self._column("recomputable", bool)

    @cached_property
    def edge_array(self) -> IntArray:
        """Edges as an (E, 2) int array, sorted by (src, dst)."""
        arr = np.array(self.edges, dtype=np.int64).reshape(-1, 2)
        arr.setflags(write=False)
        return arr

    @cached_property
    def preds(self) -> tuple[tuple[int, ...], ...]:
        """``preds[v]``: the producers whose outputs node v reads, ascending."""
        out: list[list[int]] = [[] for _ in range(self.n)]
        for u, v in self.edges:
            out[v].append(u)
        return tuple(tuple(sorted(p)) for p in out)

    @cached_property
    def succs(self) -> tuple[tuple[int, ...], ...]:
        """``succs[u]``: the consumers of node u's output, ascending."""
        out: list[list[int]] = [[] for _ in range(self.n)]
        for u, v in self.edges:
            out[u].append(v)
        return tuple(tuple(sorted(s)) for s in out)

    @cached_property
    def last_use(self) -> IntArray:
        """``last_use[u]``: the last consumer of u in id order (u itself if none)."""
        lu = np.arange(self.n, dtype=np.int64)
        if self.edges:
            e = self.edge_array
            np.maximum.at(lu, e[:, 0], e[:, 1])
        lu.setflags(write=False)
        return lu

    @property
    def total_cost(self) -> float:
        """Cost of computing every node exactly once (the no-recompute cost)."""
        return float(self.cost.sum())

    def ext_ids(self) -> list[int | str]:
        """External ids of the nodes, in id order."""
        return [nd.ext for nd in self.nodes]

    def index_of(self, ext: int | str) -> int:
        """Internal id of the node with external id ``ext``."""
        table = self._ext_index
        if ext not in table:
            raise GraphError(f"no node with id {ext!r} in graph {self.name!r}")
        return table[ext]

    @cached_property
    def _ext_index(self) -> dict[int | str, int]:
        return {nd.ext: nd.id for nd in self.nodes}

    def summary(self) -> str:
        """One line: name, nodes, edges, backward nodes."""
        nb = int(self.backward_mask.sum())
        return f"{self.name or 'graph'}: {self.n} nodes, {len(self.edges)} edges, {nb} backward"


def _cost(value: Any, key: Hashable, what: str = "cost") -> float:
    """A node's cost (or save cost) as a float; a GraphError for what is not a finite
    number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise GraphError(f"node {key!r} has {what} {value!r}: {what}s must be numbers")
    try:
        cost = float(value)
    except OverflowError:
        cost = math.inf
    if not 0 <= cost < math.inf:
        raise GraphError(f"node {key!r} has {what} {value!r}: {what}s must be finite and >= 0")
    return cost


def _size(value: Any, key: Hashable) -> int:
    """A node's size as an int; a GraphError for what is not a whole number of bytes."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise GraphError(f"node {key!r} has size {value!r}: sizes must be integers (bytes)")
    if isinstance(value, (float, np.floating)) and not (math.isfinite(value) and float(value).is_integer()):
        raise GraphError(f"node {key!r} has size {value!r}: sizes must be whole numbers of bytes")
    return int(value)


def _toposort(adj: list[set[int]], keys: Sequence[Hashable]) -> list[int]:
    """Kahn's algorithm, ties broken by input position (stable)."""
    n = len(adj)
    indeg = [0] * n
    for u in range(n):
        for v in adj[u]:
            indeg[v] += 1
    heap = [u for u in range(n) if indeg[u] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        u = heapq.heappop(heap)
        order.append(u)
        for v in adj[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, v)
    if len(order) != n:
        stuck = [keys[u] for u in range(n) if indeg[u] > 0]
        shown = ", ".join(repr(k) for k in stuck[:8]) + (" ..." if len(stuck) > 8 else "")
        raise GraphError(f"the graph has a cycle through nodes {shown}: it must be a DAG")
    return order
