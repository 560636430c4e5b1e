"""gap-cover: choose which read-to-read gaps to drop values over, as a small covering MIP.

Run the graph once in id order and hold every value from its computation to its last read:
the memory after node t runs is ``M[t]``. A *gap* is a value u between two consecutive
reads ``r < s``: dropping u right after r runs and recomputing it just before s runs frees
``mem[u]`` at every node strictly between r and s and costs ``cost[u]`` once. The
recompute reads u's inputs at s; an input p already freed by then (its last read is before
s) is held until s instead, which costs ``mem[p]`` over the nodes after its last read.

Within this policy space (every recompute is one op from resident inputs; no recompute
chains), the cheapest set of gaps that brings every ``M[t]`` under the budget is a
covering integer program with one binary per gap (O(edges) variables, not Checkmate's
O(n^2)):

    minimise   sum_g cost[u_g] x_g
    subject to sum_g a[g, t] x_g >= M[t] - budget           for every node t
               x_g + x_h <= 1     where gap h drops an input of u_g over the step that
                                  recomputes u_g (the recompute would need a chain)

with ``a[g, t] = mem[u_g]`` inside the gap and ``-mem[p]`` where the recompute holds an
input p longer. The MIP (HiGHS) is exact for the memory after each program node; a
recompute's own step holds no more than the node it serves, and the simulator replays the
result, so a plan that does not fit after all gets its overshooting rows tightened and is
solved again. This is the MIP analogue of the local "recompute from saved inputs" rule of
PyTorch's min-cut partitioner, and needs no backward pass: the random layered graphs of
Gagrani et al. (2022), on which DTR and the segment baselines find nothing, are its case.

The MIP bound is a bound on this restricted space only, so no lower bound is reported.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from solvers import highs
from solvers.errors import SolverError
from solvers.graph import Graph
from solvers.result import SolveResult, Status
from solvers.schedule import COMPUTE, Schedule, schedule_from_order, simulate
from solvers.strategies._segments import drop_sequence

__all__ = ["gap_cover", "keep_all_memory", "Gaps"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

#: simulate-and-tighten rounds before giving up on a plan that does not fit
ROUNDS = 8
#: the covering rows' nonzeros above which the MIP is not built (memory, build time);
#: a value read at both ends of a 5,000-op graph alone spans 5,000 rows
MAX_NONZEROS = 8_000_000


def keep_all_memory(graph: Graph) -> IntArray:
    """``M[t]``: bytes resident right after node t runs in the id-order run that holds
    every value from its computation to its last read (what the simulator measures)."""
    diff = np.zeros(graph.n + 1, dtype=np.int64)
    np.add.at(diff, np.arange(graph.n), graph.mem)
    np.add.at(diff, graph.last_use + 1, -graph.mem)
    return np.cumsum(diff[:-1])


def _intervals(lo: IntArray, hi: IntArray, owner: IntArray) -> tuple[IntArray, IntArray]:
    """Rows ``lo[i] .. hi[i]-1`` of each interval i, flattened: (row, owner) pairs."""
    length = np.maximum(hi - lo, 0)
    total = int(length.sum())
    if total == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    idx = np.repeat(np.arange(len(lo)), length)
    start = np.repeat(np.cumsum(length) - length, length)
    rows = lo[idx] + (np.arange(total) - start)
    return rows, owner[idx]


class Gaps:
    """The covering MIP of a graph: gap columns, input-holding columns, and its rows.

    Columns: one binary per gap (``x``), then one continuous ``w`` per (input, recompute
    step) pair: ``w[p, j] = 1`` holds p from its last read up to the j-th distinct step at
    which a chosen gap recomputes one of p's readers (``x_g <= w``, ``w[p, j+1] <= w[p, j]``),
    so a value held for several recomputes is counted once.

    Attributes:
        edge: per gap, the index in ``graph.edge_array`` of its drop point ``(u, r)``.
        value: per gap, the value u it drops.
        cover: (n, columns) bytes freed after each node runs (holding terms negative).
        links: (k, columns) rows ``<= 0`` (gap needs its hold; holds nest) and ``<= 1``
            (conflicts), with their upper bounds in ``link_upper``.

    Raises:
        SolverError: the gaps would span more than ``max_nonzeros`` covering entries.
    """

    def __init__(self, graph: Graph, max_nonzeros: int = MAX_NONZEROS) -> None:
        e = graph.edge_array.reshape(-1, 2)
        src, dst = e[:, 0], e[:, 1]
        n = graph.n
        nxt = np.flatnonzero(src[:-1] == src[1:]) if len(src) > 1 else np.zeros(0, dtype=np.int64)
        gap_edge = nxt[dst[nxt + 1] - dst[nxt] > 1]  # a gap covers at least one node
        recomputable = graph.recomputable_mask[src[gap_edge]] & (graph.mem[src[gap_edge]] > 0)
        gap_edge = gap_edge[recomputable].astype(np.int64)
        self.edge: IntArray = gap_edge
        u, r, s = src[gap_edge], dst[gap_edge], dst[gap_edge + 1]
        self.value: IntArray = u.astype(np.int64)
        m = len(gap_edge)
        g = np.arange(m, dtype=np.int64)
        self.size = int(np.maximum(s - r - 1, 0).sum())
        if self.size > max_nonzeros:
            raise SolverError(
                f"gap-cover: the covering model would have {self.size:,} nonzeros (limit "
                f"{max_nonzeros:,}); use peak-greedy or lp-rounding on this graph"
            )
        rows, cols = _intervals(r + 1, s, g)
        data = graph.mem[u][cols].astype(np.float64)
        # the inputs of each gap's recompute: edges (p, u_g)
        by_dst = np.argsort(dst, kind="stable")
        lo = np.searchsorted(dst[by_dst], u, side="left")
        hi = np.searchsorted(dst[by_dst], u, side="right")
        pos, k = _intervals(lo, hi, g)
        p = src[by_dst[pos]]
        at = s[k]
        last = graph.last_use[p]
        freed = last < at  # held from after its last read until the recompute
        # hold columns: distinct (p, step) pairs, in order of p then step
        hp, hat, hk = p[freed], at[freed], k[freed]
        pairs, inverse = np.unique(hp * (n + 1) + hat, return_inverse=True)
        wp, wat = pairs // (n + 1), pairs % (n + 1)
        nw = len(pairs)
        first = np.ones(nw, dtype=bool)
        first[1:] = wp[1:] != wp[:-1]
        # held through the recompute, which runs before node ``wat`` (and frees it after)
        start = np.where(first, graph.last_use[wp] + 1, np.concatenate([[0], wat[:-1] + 1]))
        wr, wc = _intervals(start, wat + 1, np.arange(nw, dtype=np.int64))
        self.cover = sp.csr_matrix(
            (
                np.concatenate([data, -graph.mem[wp][wc].astype(np.float64)]),
                (np.concatenate([rows, wr]), np.concatenate([cols, m + wc])),
            ),
            shape=(n, m + nw),
        )
        self.cover.sum_duplicates()
        # x_g - w <= 0 ; w[p, j+1] - w[p, j] <= 0
        need_r = np.arange(len(hk))
        nest = np.flatnonzero(~first)
        link_rows = [need_r, need_r, len(hk) + np.arange(len(nest)), len(hk) + np.arange(len(nest))]
        link_cols = [hk, m + inverse, m + nest, m + nest - 1]
        link_data = [np.ones(len(hk)), -np.ones(len(hk)), np.ones(len(nest)), -np.ones(len(nest))]
        base = len(hk) + len(nest)
        # an input p still live at the recompute may itself be dropped over it: conflict
        live = ~freed
        key = src * n + dst
        want = p[live] * n + at[live]
        where = np.searchsorted(key, want)
        read_there = (where < len(key)) & (key[np.minimum(where, len(key) - 1)] == want)
        gap_of_edge = np.full(len(src), -1, dtype=np.int64)
        gap_of_edge[gap_edge] = g
        other = gap_of_edge[where[~read_there] - 1]  # p's gap from its last read before
        mine = k[live][~read_there]
        ok = other >= 0
        nc = int(ok.sum())
        self.conflicts: IntArray = np.stack([mine[ok], other[ok]], axis=1)
        crow = base + np.repeat(np.arange(nc), 2)
        self.links = sp.csr_matrix(
            (
                np.concatenate([*link_data, np.ones(2 * nc)]),
                (
                    np.concatenate([*link_rows, crow]),
                    np.concatenate([*link_cols, self.conflicts.reshape(-1)]),
                ),
            ),
            shape=(base + nc, m + nw),
        )
        self.link_upper: FloatArray = np.concatenate([np.zeros(base), np.ones(nc)])
        self.holds = nw

    def __len__(self) -> int:
        return len(self.edge)


def gap_cover(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    rounds: int = ROUNDS,
    **options: Any,
) -> SolveResult:
    """Solve the gap-covering MIP (see the module docstring) and replay its plan.

    Args:
        graph: the graph to plan.
        budget: bytes.
        time_limit: seconds for the whole search (model build, MIP solves, replays); the
            MIP keeps its best incumbent when time runs out.
        rounds: simulate-and-tighten rounds when a plan's replay exceeds the budget.

    Returns:
        FEASIBLE with the replayed schedule (the MIP is exact only within its policy
        space, so never OPTIMAL), else NO_SOLUTION with the reason.
    """
    t0 = time.perf_counter()
    deadline = None if time_limit is None else t0 + max(float(time_limit), 0.0)
    M = keep_all_memory(graph)
    need = M.astype(np.float64) - float(budget)
    info: dict[str, Any] = {}
    if need.max(initial=0.0) <= 0:
        sched = schedule_from_order(graph, range(graph.n))
        sim = simulate(graph, sched)
        return SolveResult("gap-cover", Status.FEASIBLE, budget, schedule=sched, cost=sim.cost, peak=sim.peak,
                           build_seconds=time.perf_counter() - t0, info={"gaps": 0})  # fmt: skip
    try:
        gaps = Gaps(graph, MAX_NONZEROS)
    except SolverError as exc:
        info["message"] = str(exc)
        return SolveResult(
            "gap-cover", Status.NO_SOLUTION, budget, build_seconds=time.perf_counter() - t0, info=info
        )
    info.update(gaps=len(gaps), holds=gaps.holds, conflicts=len(gaps.conflicts))
    m = len(gaps)
    cols = m + gaps.holds
    rows_needed = np.flatnonzero((need > 0) | (np.asarray(gaps.cover.getnnz(axis=1)) > 0))
    cover = gaps.cover[rows_needed]
    uncovered = (need[rows_needed] > 0) & (cover[:, :m].getnnz(axis=1) == 0)
    build = time.perf_counter() - t0
    if m == 0 or uncovered.any():
        info["message"] = "gap-cover: no gap covers a node where the keep-all run exceeds the budget"
        return SolveResult("gap-cover", Status.NO_SOLUTION, budget, build_seconds=build, info=info)
    nl = gaps.links.shape[0]
    A = sp.vstack([cover, gaps.links]).tocsc()
    cost = np.zeros(cols)
    cost[:m] = graph.cost[gaps.value] + 1e-9 * max(float(graph.total_cost), 1.0)  # no drop for nothing
    integrality = np.zeros(cols, dtype=bool)
    integrality[:m] = True
    lower = need[rows_needed].copy()
    best: tuple[Schedule, Any] | None = None
    for rnd in range(max(int(rounds), 1)):
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
            break
        problem = highs.HighsProblem(
            A=A,
            row_lower=np.concatenate([lower, np.full(nl, -np.inf)]),
            row_upper=np.concatenate([np.full(len(lower), np.inf), gaps.link_upper]),
            col_lower=np.zeros(cols),
            col_upper=np.ones(cols),
            cost=cost,
            integrality=integrality,
        )
        res = highs.solve(problem, time_limit=left, mip_rel_gap=float(options.get("mip_rel_gap", 1e-3)))
        info[f"round{rnd}"] = str(res.model_status)
        if res.x is None:
            info["message"] = f"gap-cover: the covering MIP found no plan ({res.model_status})"
            break
        drop = np.zeros(len(graph.edges), dtype=bool)
        drop[gaps.edge[res.x[:m] > 0.5]] = True
        seq, owner = drop_sequence(graph, drop)
        sched = schedule_from_order(graph, seq)
        sim = simulate(graph, sched)
        if sim.peak <= budget:
            best = (sched, sim)
            info["drops"] = int(drop.sum())
            break
        # tighten the rows of the program nodes whose steps overshoot, and solve again
        over = _overshoot(graph, sched, sim.timeline, owner) - budget
        hit = np.flatnonzero(over > 0)
        row_of = np.full(graph.n, -1, dtype=np.int64)
        row_of[rows_needed] = np.arange(len(rows_needed))
        lower[row_of[hit]] += over[hit]
        info["rounds"] = rnd + 1
    elapsed = time.perf_counter() - t0
    if best is None:
        info.setdefault(
            "message", f"gap-cover: no plan within the budget after {info.get('rounds', 0)} rounds"
        )
        return SolveResult("gap-cover", Status.NO_SOLUTION, budget, build_seconds=build,
                           solve_seconds=elapsed - build, info=info)  # fmt: skip
    sched, sim = best
    return SolveResult("gap-cover", Status.FEASIBLE, budget, schedule=sched, cost=sim.cost, peak=sim.peak,
                       build_seconds=build, solve_seconds=elapsed - build, info=info)  # fmt: skip


def _overshoot(graph: Graph, sched: Schedule, timeline: IntArray, owner: list[int]) -> IntArray:
    """Per program node, the most memory any of its compute steps (recomputes included) reached."""
    worst = np.zeros(graph.n, dtype=np.int64)
    k = 0
    for s, (op, _) in enumerate(sched.steps):
        if op == COMPUTE:
            v = owner[k]
            worst[v] = max(worst[v], int(timeline[s]))
            k += 1
    return worst
