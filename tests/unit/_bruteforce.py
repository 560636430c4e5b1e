"""Exhaustive optimum of tiny rematerialization problems: a test oracle, independent of
every strategy (Dijkstra over resident sets, same memory convention as the simulator)."""

from __future__ import annotations

import heapq
import random

from solvers.graph import Graph


def optimal_cost(
    graph: Graph,
    budget: int,
    *,
    staged: bool = False,
    boundary: int | None = None,
    max_states: int = 2_000_000,
) -> float | None:
    """Least cost of a schedule of ``graph`` whose first computes follow id order and whose
    peak (after each compute, before the frees) stays within ``budget``; None if none.

    With ``staged``, recomputes between two first computes also run in increasing id order
    (the Checkmate MILP's stage structure, which the CP-SAT model shares). With
    ``boundary``, at most that many bytes are resident right before the first compute of a
    backward node (the first compute of ``graph.first_backward``, as first computes follow
    id order).
    """
    n = graph.n
    preds = [sum(1 << p for p in graph.preds[v]) for v in range(n)]
    mem = [int(x) for x in graph.mem]
    cost = [float(x) for x in graph.cost]
    recomputable = list(graph.recomputable_mask)
    # state: (resident bitmask, frontier = next first compute, last id computed in the stage)
    start = (0, 0, -1)
    dist = {start: 0.0}
    heap = [(0.0, start)]
    while heap:
        d, state = heapq.heappop(heap)
        if d > dist.get(state, float("inf")):
            continue
        res, frontier, last = state
        if frontier == n:
            return d
        if len(dist) > max_states:
            raise RuntimeError("brute force: too many states")
        used = sum(mem[i] for i in range(n) if res >> i & 1)
        moves: list[tuple[float, tuple[int, int, int]]] = []
        for j in range(frontier + 1):
            if res >> j & 1 or (res & preds[j]) != preds[j] or used + mem[j] > budget:
                continue
            if j == frontier:
                if boundary is not None and j == graph.first_backward and used > boundary:
                    continue
                moves.append((cost[j], (res | 1 << j, frontier + 1, -1)))
            elif recomputable[j] and (not staged or j > last):
                moves.append((cost[j], (res | 1 << j, frontier, j)))
        for i in range(n):
            if res >> i & 1:
                moves.append((0.0, (res & ~(1 << i), frontier, last)))
        for c, nxt in moves:
            nd = d + c
            if nd < dist.get(nxt, float("inf")) - 1e-12:
                dist[nxt] = nd
                heapq.heappush(heap, (nd, nxt))
    return None


def random_dag(
    seed: int, n: int, *, p_edge: float = 0.35, zero_frac: float = 0.0, backward: bool = False
) -> Graph:
    """A small random DAG with integer costs and sizes (some sizes zero if asked)."""
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        mem = 0 if rng.random() < zero_frac else rng.randint(1, 6)
        nodes.append(
            {
                "key": i,
                "name": f"n{i}",
                "cost": float(rng.randint(1, 5)),
                "mem": mem,
                "backward": backward and i >= n // 2,
            }
        )
    edges = [(u, v) for v in range(1, n) for u in range(v) if rng.random() < p_edge]
    # keep it connected-ish: every node but the first reads its predecessor
    edges += [(v - 1, v) for v in range(1, n) if rng.random() < 0.7]
    return Graph.build(nodes, sorted(set(edges)), name=f"random{seed}")
